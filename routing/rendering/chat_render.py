"""A conversation's next turn rendered without rendering its earlier messages again.

An agent re-sends its whole conversation every turn, and a chat template renders every message each time: on a
200K-token session that was most of the router's per-turn cost. Most templates render each message from that
message, its neighbours and its position alone. For such a template the message loop is cut out of it, each
message is rendered on its own, and what a message rendered to last turn is reused while the message, the
neighbours its text depends on and everything else the template saw are unchanged. The result is exactly the
template's own: a template whose loop might depend on more (a namespace it writes, the loop's length, anything
hidden) is rendered whole, and a test renders both ways over many conversations and compares them.

Over 400 lines: cutting a template's message loop out and rendering it message by message is one algorithm whose
parts rely on each other's checks of what the template reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import jinja2
from jinja2 import nodes
from jinja2.runtime import Macro
from jinja2.utils import Namespace

# A loop attribute the message loop's body may read, and which neighbour its value depends on.
LOOP_ATTRIBUTES = {"index0": 0, "index": 0, "first": 0, "previtem": -1, "nextitem": 1, "last": 1}
INELIGIBLE = (
    nodes.Extends,
    nodes.Include,
    nodes.Import,
    nodes.FromImport,
    nodes.Block,
    nodes.EvalContextModifier,
)


class Ineligible(Exception):
    """The template's message loop may depend on more than its message's neighbours: render it whole."""


class MessageLoop:
    """What the message loop's body reads of `loop`, for one message rendered on its own."""

    __slots__ = ("index0", "index", "first", "last", "_messages", "_undefined")

    def __init__(self, messages: list, index0: int, undefined):
        self.index0, self.index = index0, index0 + 1
        self.first, self.last = index0 == 0, index0 == len(messages) - 1
        self._messages, self._undefined = messages, undefined

    @property
    def previtem(self):
        if self.first:
            return self._undefined("there is no previous item")
        return self._messages[self.index0 - 1]

    @property
    def nextitem(self):
        if self.last:
            return self._undefined("there is no next item")
        return self._messages[self.index]


@dataclass
class RenderedTurn:
    """What rendering a conversation left to reuse: the messages, what each rendered to, and everything else
    the template saw (its variables and those the part before the loop set)."""

    messages: list = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    given: dict | None = None  # the template's variables but `messages`
    head: str = ""  # what the part before the loop rendered to
    assigned: dict = field(default_factory=dict)  # the variables it set
    seen: dict | None = None  # those, comparable
    text: str = ""  # the whole render


class SplitTemplate:
    """A chat template cut at its message loop: the part before it, the loop's body (rendered per message) and
    the part after it. A message's text may depend on the messages from `low` to `high` places away from it and
    on those up to index `fixed`; Ineligible when the template's loop may depend on more."""

    def __init__(self, env: jinja2.Environment, source: str):
        tree = env.parse(source)
        for node in tree.find_all(INELIGIBLE):
            raise Ineligible(f"the template uses {type(node).__name__}")
        loops = [
            i
            for i, node in enumerate(tree.body)
            if isinstance(node, nodes.For)
            and isinstance(node.iter, nodes.Name)
            and node.iter.name == "messages"
        ]
        if len(loops) != 1:
            raise Ineligible("the template has no single top-level loop over `messages`")
        loop = tree.body[loops[0]]
        if loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
            raise Ineligible("the message loop filters, recurses or unpacks")
        self.target = loop.target.name
        self.low, self.high, self.fixed = 0, 0, -1  # neighbours and the highest fixed index read
        for node in loop.body:
            self._check(node, nested=False)
        macros = {macro.name for macro in tree.find_all(nodes.Macro)}
        for macro in tree.find_all((nodes.Macro, nodes.CallBlock)):
            params = {arg.name for arg in macro.args}
            for child in macro.body:
                _check_macro(child, {"messages", "loop", self.target} - params)
                _check_calls(child, macros)
        for node in loop.body:
            _check_calls(node, macros)
        # The part before the loop is rendered again only when something it can read changed: when it reads no
        # message but by a fixed index, calls nothing that could answer differently, and no namespace it sets
        # is written after the loop.
        self.pre_fixed: int | None = -1
        try:
            for node in tree.body[: loops[0]]:
                _check_calls(node, macros)
                self.pre_fixed = max(self.pre_fixed, _fixed_reads(node))
            if any(
                isinstance(item, nodes.NSRef) for node in tree.body[loops[0] + 1 :] for item in _walk(node)
            ):
                raise Ineligible("the part after the loop writes a namespace")
        except Ineligible:
            self.pre_fixed = None
        self.env = env
        self.pre = self._compile(tree.body[: loops[0]])
        self.body = self._compile(loop.body)
        self.post = self._compile(tree.body[loops[0] + 1 :])

    def _compile(self, body: list) -> jinja2.Template:
        tree = nodes.Template(body, lineno=1)
        tree.set_environment(self.env)
        return self.env.template_class.from_code(
            self.env, self.env.compile(tree), self.env.make_globals(None), None
        )

    def _check(self, node: nodes.Node, nested: bool) -> None:
        """Walk the loop body: `loop` only as an allowed attribute, `messages` only indexed by a constant or by
        the loop's position plus a constant, no namespace written, no break or continue of this loop."""
        if isinstance(node, nodes.For):
            self._check(node.iter, nested)
            if node.test is not None and any(n.name == "loop" for n in node.test.find_all(nodes.Name)):
                raise Ineligible("an inner loop's filter reads `loop`")
            for child in [node.target, *node.body, *([node.test] if node.test else [])]:
                self._check(child, nested=True)
            for child in node.else_:  # where `loop` may be the message loop's
                self._check(child, nested)
            return
        if isinstance(node, nodes.NSRef):
            raise Ineligible("the message loop writes a namespace")
        if not nested and isinstance(node, nodes.Continue | nodes.Break):
            raise Ineligible("the message loop uses break or continue")
        if isinstance(node, nodes.Getattr) and _is_name(node.node, "loop"):
            if nested:
                return  # an inner loop's own `loop`
            if node.attr not in LOOP_ATTRIBUTES:
                raise Ineligible(f"the message loop reads loop.{node.attr}")
            self._neighbour(LOOP_ATTRIBUTES[node.attr])
            return
        if isinstance(node, nodes.Getitem) and _is_name(node.node, "messages"):
            arg = node.arg
            if isinstance(arg, nodes.Const) and isinstance(arg.value, int) and arg.value >= 0:
                self.fixed = max(self.fixed, arg.value)
                return
            offset = None if nested else _position_offset(arg)
            if offset is None:
                raise Ineligible("the message loop indexes `messages` by more than its position")
            self._neighbour(offset)
            return
        if isinstance(node, nodes.Name):
            if node.name in ("loop", "messages") and not (nested and node.name == "loop"):
                raise Ineligible(f"the message loop uses `{node.name}` as a whole")
            if node.ctx != "load" and node.name == self.target:
                raise Ineligible("the message loop assigns its own target")
            return
        for child in node.iter_child_nodes():
            self._check(child, nested)

    def _neighbour(self, offset: int) -> None:
        self.low, self.high = min(self.low, offset), max(self.high, offset)

    def render(self, variables: dict, previous: RenderedTurn | None) -> tuple[str, RenderedTurn, int]:
        """The template rendered with `variables` (messages among them), reusing what `previous` rendered for
        the leading messages it had too; what this render leaves for the next turn; and how many leading
        characters of the text are known to equal `previous.text`'s."""
        messages = variables["messages"]
        given = {k: v for k, v in variables.items() if k != "messages"}
        same = previous is not None and previous.given == given
        shared = _shared_prefix(messages, previous.messages) if same else 0
        if same and self.pre_fixed is not None and shared > self.pre_fixed:
            head, assigned, seen = previous.head, previous.assigned, previous.seen
        else:
            context = self.pre.new_context(variables)
            head = "".join(self.pre.root_render_func(context))
            assigned = context.vars
            seen = {k: _comparable(v) for k, v in assigned.items()}
        reusable = 0
        if same and previous.seen == seen and shared > self.fixed:
            reusable = min(shared - self.high, len(previous.pieces))
        names = {**self.body.globals, **variables, **assigned}  # what a message sees in the loop
        first = min(-self.low, reusable)  # messages whose neighbour before them would wrap to the end
        pieces = [self._piece(names, messages, i) for i in range(first)]
        pieces += previous.pieces[first:reusable] if reusable > first else ()
        pieces += [self._piece(names, messages, i) for i in range(len(pieces), len(messages))]
        tail = "".join(self.post.root_render_func(self.post.new_context(names, shared=True)))
        text = "".join([head, *pieces, tail])
        known = 0
        if previous is not None and (head is previous.head or head == previous.head):
            # The leading pieces equal to last turn's: those reused, and any rendered again alike around them.
            equal, old = 0, previous.pieces
            while equal < len(pieces) and equal < len(old):
                if equal == first and reusable > first:
                    equal = reusable
                    continue
                if pieces[equal] != old[equal]:
                    break
                equal += 1
            known = len(head) + sum(map(len, pieces[:equal]))
        return text, RenderedTurn(list(messages), pieces, given, head, assigned, seen, text), known

    def _piece(self, names: dict, messages: list, i: int) -> str:
        """What the loop's body renders for message `i`."""
        loop = MessageLoop(messages, i, self.env.undefined)
        context = self.body.new_context(names | {self.target: messages[i], "loop": loop}, shared=True)
        return "".join(self.body.root_render_func(context))


def _check_macro(node: nodes.Node, hidden: set[str]) -> None:
    """A macro is called from the message loop with the loop's variables out of its sight: one that reads
    `messages`, `loop` (outside a loop of its own) or the loop's target name would see them in a message
    rendered on its own."""
    if isinstance(node, nodes.Name) and node.name in hidden:
        raise Ineligible(f"a macro reads `{node.name}`")
    if isinstance(node, nodes.For):
        _check_macro(node.iter, hidden)
        for child in [*node.body, *node.else_, *([node.test] if node.test else [])]:
            _check_macro(child, hidden - {"loop"})
        return
    for child in node.iter_child_nodes():
        _check_macro(child, hidden)


PURE_CALLS = frozenset({"raise_exception", "namespace", "range", "dict", "caller"})
PURE_METHODS = frozenset(name for name in dir(str) if not name.startswith("_")) | {
    "get",
    "items",
    "keys",
    "values",
}
IMPURE_FILTERS = frozenset({"random", "shuffle"})


def _walk(node: nodes.Node):
    yield node
    yield from node.find_all(nodes.Node)


def _check_calls(node: nodes.Node, macros: set[str]) -> None:
    """Everything called answers the same for the same arguments: the template's macros, a few globals and the
    methods of strings and mappings (not a joiner, a cycler or a clock, whose answer depends on when)."""
    for item in _walk(node):
        if isinstance(item, nodes.Filter) and item.name in IMPURE_FILTERS:
            raise Ineligible(f"the template uses the {item.name} filter")
        if not isinstance(item, nodes.Call):
            continue
        callee = item.node
        if isinstance(callee, nodes.Name) and (callee.name in PURE_CALLS or callee.name in macros):
            continue
        if isinstance(callee, nodes.Getattr) and callee.attr in PURE_METHODS:
            continue
        raise Ineligible("the template calls something that may answer differently each time")


def _fixed_reads(node: nodes.Node) -> int:
    """The highest fixed index of `messages` that `node` reads; Ineligible where it reads it otherwise."""
    highest, indexed = -1, set()
    for item in _walk(node):
        if isinstance(item, nodes.Getitem) and _is_name(item.node, "messages"):
            arg = item.arg
            if not (isinstance(arg, nodes.Const) and isinstance(arg.value, int) and arg.value >= 0):
                raise Ineligible("the part before the loop reads `messages` by more than a fixed index")
            highest = max(highest, arg.value)
            indexed.add(id(item.node))
    if any(_is_name(item, "messages") and id(item) not in indexed for item in _walk(node)):
        raise Ineligible("the part before the loop reads `messages` as a whole")
    return highest


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def _position_offset(arg: nodes.Node) -> int | None:
    """`loop.index0 + c`, `loop.index - c` and the like as the offset from the message's own index."""
    sign = 1
    if isinstance(arg, nodes.Add | nodes.Sub) and isinstance(arg.right, nodes.Const):
        constant = arg.right.value
        if not isinstance(constant, int) or isinstance(constant, bool):
            return None
        sign, arg, constant = (1 if isinstance(arg, nodes.Add) else -1), arg.left, constant
    else:
        constant = 0
    if isinstance(arg, nodes.Getattr) and _is_name(arg.node, "loop") and arg.attr in ("index0", "index"):
        return sign * constant + (1 if arg.attr == "index" else 0)
    return None


def _comparable(value):
    """A value the part before the loop set, as it can be compared with last turn's: a namespace by its
    attributes, a macro by its name (its code is the template's; what it reads is compared on its own)."""
    if isinstance(value, Namespace):
        return ("namespace", dict(object.__getattribute__(value, "_Namespace__attrs")))
    if isinstance(value, Macro):
        return ("macro", value.name)
    return value


def _shared_prefix(new: list, old: list) -> int:
    """How many leading items `new` and `old` have equal (items reused from last turn are the same objects)."""
    count = 0
    for a, b in zip(new, old, strict=False):
        if a is not b and a != b:
            break
        count += 1
    return count


class Conversions:
    """A per-message conversion's results as last computed, reused for the leading messages equal to last
    time's: `map` is the conversions' `each` (routing/rendering/conversion.py)."""

    def __init__(self, items: list | None = None, results: list | None = None):
        self.items, self.results = items or [], results or []

    def map(self, items: list, convert) -> list:
        shared = _shared_prefix(items, self.items)
        results = self.results[:shared]
        results.extend(convert(item) for item in items[shared:])
        self.items, self.results = list(items), results
        return results

    def copy(self) -> Conversions:
        return Conversions(list(self.items), list(self.results))


@dataclass
class Conversation:
    """What a conversation's last turn converted and rendered to."""

    conversions: dict[str, Conversions] = field(default_factory=dict)
    turn: RenderedTurn | None = None
    raw: list = field(default_factory=list)  # the request's messages, as last rendered
    counted: int = 0  # the characters counted for it against the bound

    def layer(self, name: str) -> Conversions:
        return self.conversions.setdefault(name, Conversions())

    @property
    def size(self) -> int:
        return len(self.turn.text) if self.turn else 0  # about what its pieces hold


HEAD_CHARS = 200
PER_HEAD = 4  # conversations kept that start alike (an agent's branches, or sub-agents given the same task)


class Conversations:
    """Recent conversations, grouped by how their first two messages start, bounded by the characters their
    renders hold and by the number of groups (many short conversations hold few characters each)."""

    def __init__(self, max_chars: int, max_groups: int = 4096):
        self.max_chars, self.max_groups = max_chars, max_groups
        self._groups: dict[tuple, list[Conversation]] = {}
        self._chars = 0

    def find(self, kind: str, messages: list) -> Conversation:
        """The recent conversation sharing the most leading messages with `messages`, to continue (or, where
        `messages` branches off from it, a copy to continue); a new one when none does."""
        key = (kind, *(_head(message) for message in messages[:2]))
        group = self._groups.pop(key, [])
        self._groups[key] = group  # most recently used last
        # Which one to continue is a guess (what is reused is checked message by message): one whose last
        # message this request has at the same place, else the one sharing the most leading messages.
        found = next((c for c in reversed(group) if _continues(messages, c.raw)), None)
        if found is not None:
            group.remove(found)
        else:
            best, shared = None, 0
            for candidate in reversed(group):
                count = _shared_prefix(messages, candidate.raw)
                if count > shared:
                    best, shared = candidate, count
            found = Conversation()
            if best is not None:  # a branch: continued from a copy, the other branch kept as it was
                found = Conversation({k: v.copy() for k, v in best.conversions.items()}, best.turn, best.raw)
        group.append(found)
        if len(group) > PER_HEAD:
            self._chars -= group.pop(0).counted
        return found

    def rendered(self, conversation: Conversation, messages: list, turn: RenderedTurn) -> None:
        """Keep `conversation`'s new render, dropping the least recently used conversations past the bound."""
        conversation.raw, conversation.turn = messages, turn
        size = conversation.size
        self._chars += size - conversation.counted
        conversation.counted = size
        while (self._chars > self.max_chars or len(self._groups) > self.max_groups) and len(self._groups) > 1:
            oldest = next(iter(self._groups))
            self._chars -= sum(c.counted for c in self._groups.pop(oldest))


def _continues(messages: list, previous: list) -> bool:
    return 0 < len(previous) <= len(messages) and messages[len(previous) - 1] == previous[-1]


def _head(message) -> tuple:
    """A message's role and the start of its first text."""
    if not isinstance(message, dict):
        return (type(message).__name__,)
    content = message.get("content")
    if isinstance(content, list) and content:
        content = content[0]
        if isinstance(content, dict):
            content = content.get("text", content.get("content", content.get("type")))
    return (message.get("role"), content[:HEAD_CHARS] if isinstance(content, str) else type(content).__name__)
