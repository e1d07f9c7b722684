"""Tokenisation in the router, with the deployment's own tokenizer and chat template.

Agents resend a growing context every turn. The rendered chat is cut at the template's special tokens (which the
tokenizer never merges with their neighbours), and each piece's token ids are cached, so a new turn costs work in
proportion to its new text, and the ids equal those of tokenising the whole text at once, as the engine does.

Over 400 lines: the template's loading and the tokenizer's caches (pieces, recent texts, the ids shared through
Redis) are one object's state."""

from __future__ import annotations

import bisect
import json
import logging
import re
from array import array
from collections import OrderedDict
from pathlib import Path

import jinja2
import jinja2.nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from routing.rendering.chat_render import Conversation, Conversations, Ineligible, MessageLoop, SplitTemplate
from routing.rendering.conversion import (
    ChatInputs,
    RenderError,
    TemplateTraits,
    anthropic_chat_request,
    chat_inputs,
    each,
    responses_chat_request,
)
from routing.rendering.fast_bpe import fast_encoder
from routing.rendering.routes import ANTHROPIC_MESSAGES, CHAT_COMPLETIONS, RESPONSES_INPUT, ROUTES
from routing.rendering.shared_tokens import SharedPieces

log = logging.getLogger(__name__)


def token_ids(prompt) -> array | None:
    """A prompt sent as a list of token ids (as vLLM's completions API takes it), as an array; None for anything
    else, including ids no tokenizer could have made (negative, over 32 bits, not integers)."""
    if not isinstance(prompt, list) or not prompt:
        return None
    try:
        return array("I", prompt)  # converted and checked in C: a per-item isinstance costs 5x as much
    except (TypeError, OverflowError):
        return None


class SegmentCache:
    """An LRU of text piece -> token ids, bounded by the number of ids it holds."""

    def __init__(self, max_tokens: int = 20_000_000):
        self.max_tokens = max_tokens
        self._items: OrderedDict[str, array] = OrderedDict()
        self._size = 0
        self.hits = 0
        self.misses = 0
        self.shared_hits = 0

    def __contains__(self, text: str) -> bool:
        return text in self._items

    def get(self, text: str) -> array | None:
        ids = self._items.get(text)
        if ids is not None:
            self._items.move_to_end(text)
            self.hits += 1
        return ids

    def put(self, text: str, ids: array, *, shared: bool = False) -> None:
        """`shared`: the ids came from another replica (routing/rendering/shared_tokens.py), not from tokenising here."""
        if shared:
            self.shared_hits += 1
        else:
            self.misses += 1
        self._items[text] = ids
        self._size += len(ids)
        while self._size > self.max_tokens and self._items:
            _, dropped = self._items.popitem(last=False)
            self._size -= len(dropped)


def template_traits(template: str | None) -> TemplateTraits:
    """What vLLM detects in a chat template before rendering: whether it loops over a message's content parts
    (then text parts reach it as a list, else joined with newlines) and whether it names the developer role."""
    if not template:
        return TemplateTraits()
    developer = '"developer"' in template or "'developer'" in template
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return TemplateTraits(developer_role=developer)
    loops_over_content = any(_is_content(loop.iter) for loop in tree.find_all(jinja2.nodes.For))
    return TemplateTraits("openai" if loops_over_content else "string", developer)


def _is_content(node) -> bool:
    """`message['content']`, `message.content` or a variable named content."""
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Filter):
        return _is_content(node.node)
    return False


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """Jinja's sandbox, as the engine renders templates (a model's template is code from its folder), with one
    shortcut: the public attributes of a loop (`loop.first`, `loop.index0`, ...) are read directly. Templates read
    them for every message, and the sandbox's checks of each read were a third of a long conversation's render;
    a loop object is Jinja's own and its public attributes are plain values."""

    def getattr(self, obj, attribute: str):
        if (obj.__class__ is LoopContext or obj.__class__ is MessageLoop) and not attribute.startswith("_"):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


RECENT_HEAD = 256  # recent texts are grouped by their first characters
RECENT_PER_HEAD = 4
RECENT_MAX_CHARS = 16_000_000  # about 16 MB of text and 16 MB of ids at 4 characters a token


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


class RouterTokenizer:
    def __init__(
        self, model_dir: str | Path, cache: SegmentCache | None = None, chat_template: str | None = None
    ):
        """`chat_template`: the deployment's override of the model's own template (as the engine is given it)."""
        folder = Path(model_dir)
        # Where it was loaded from and the deployment's template: what a worker process loads it again from.
        self.folder, self.chat_template_override = folder, chat_template or ""
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # tiktoken, where it gives exactly this tokenizer's ids, at about a tenth of its time (routing/rendering/fast_bpe.py).
        self.fast = fast_encoder(self.tokenizer, folder.name)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        self.cache = cache or SegmentCache()
        # The other replicas' ids of pieces (routing/rendering/shared_tokens.py), when the router shares them.
        self.shared: SharedPieces | None = None
        self._recent: OrderedDict[str, list[tuple[str, array, list]]] = OrderedDict()
        self._recent_chars = 0
        self.special = {
            token.content: token_id
            for token_id, token in self.tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(self.special, key=len, reverse=True)) + ")"
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self.traits = template_traits(template)
        self.merge_inline_system = rejects_inline_system(template)
        self.multimodal = _is_multimodal(folder)
        env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template) if template else None
        self.template_source = template or ""
        self.split: SplitTemplate | None = None
        if template:
            try:
                self.split = SplitTemplate(env, template)
            except Ineligible as exc:  # rendered whole every turn
                log.info("%s: each turn renders the whole chat template: %s", folder.name, exc)
        self.conversations = Conversations(RECENT_MAX_CHARS)

    def chat_inputs(
        self, payload: dict, path: str = CHAT_COMPLETIONS.path, conversation: Conversation | None = None
    ) -> ChatInputs:
        """What the engine's template will see for a request to `path` (a route rendered as chat completions,
        Anthropic messages or Responses: routing/rendering/routes.py); RenderError when it cannot be rendered. With
        `conversation`, the messages converted for its last turn are reused where they are unchanged (Responses
        input items, which join each other, are converted whole)."""
        renders = ROUTES[path].renders
        if renders == ANTHROPIC_MESSAGES:
            payload = anthropic_chat_request(
                payload,
                merge_inline_system=self.merge_inline_system,
                each=conversation.layer("anthropic").map if conversation else each,
            )
        elif renders == RESPONSES_INPUT:
            payload = responses_chat_request(payload)
        return chat_inputs(
            payload, self.traits, each=conversation.layer("chat").map if conversation else each
        )

    def render(self, inputs: ChatInputs) -> str:
        if self.template is None:
            raise RenderError("no_template", "this model has no chat template")
        messages = inputs.messages
        final = None
        if inputs.kwargs.get("continue_final_message"):
            messages, final = self._tag_final_message(messages)
        try:
            text = self.template.render(self._variables(messages, inputs))
        except jinja2.TemplateError as exc:
            raise RenderError("template_error", f"the chat template refused the request: {exc}") from exc
        return text if final is None else _cut_at_tag(text, final)

    def _variables(self, messages: list[dict], inputs: ChatInputs) -> dict:
        return {
            "messages": messages,
            "tools": inputs.tools,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **inputs.kwargs,
        }

    def render_request(self, payload: dict, path: str) -> str:
        """A chat, Anthropic messages or Responses request's prompt text, as `render(chat_inputs(...))` gives it. For a
        conversation's next turn, the messages it shares with a recent turn are neither converted nor rendered
        again (routing/rendering/chat_render.py). A message object is taken as unchanged when it is the very object seen
        before: a caller must not change a request's messages in place once rendered (the router parses each
        request afresh)."""
        return self.render_prompt(payload, path)[0]

    def render_prompt(self, payload: dict, path: str) -> tuple[str, tuple[str, int] | None]:
        """The prompt text, and the recent text its leading characters are known to equal, with how many (for
        `encode_text`)."""
        route = ROUTES[path]
        messages = payload.get(route.prompt)
        if self.split is None or not route.templated or not isinstance(messages, list) or not messages:
            return self.render(self.chat_inputs(payload, path)), None
        conversation = self.conversations.find(path, messages)
        inputs = self.chat_inputs(payload, path, conversation)
        if inputs.kwargs.get("continue_final_message"):
            return self.render(inputs), None
        previous = conversation.turn
        try:
            text, turn, known = self.split.render(self._variables(inputs.messages, inputs), previous)
        except jinja2.TemplateError as exc:
            raise RenderError("template_error", f"the chat template refused the request: {exc}") from exc
        self.conversations.rendered(conversation, messages, turn)
        return text, (previous.text, known) if known else None

    def _tag_final_message(self, messages: list[dict]) -> tuple[list[dict], str]:
        """The conversation with a tag after the final message's text, as transformers marks where a message to
        continue ends (the rendered text is cut there)."""
        if not messages or messages[-1].get("content") is None:
            raise RenderError(
                "continue_final_message", "continue_final_message needs a final message with content"
            )
        if "content" not in self.template_source:
            raise RenderError("continue_final_message", "the chat template does not render message content")
        last = dict(messages[-1])
        content = last["content"]
        if isinstance(content, list):
            blocks = [dict(block) for block in content]
            for block in reversed(blocks):
                if "text" in block:
                    final = block["text"]
                    block["text"] = final + CONTINUE_TAG
                    break
            else:
                raise RenderError("continue_final_message", "the final message has no text to continue")
            last["content"] = blocks
        else:
            final = content
            last["content"] = content + CONTINUE_TAG
        return [*messages[:-1], last], final

    def render_chat(self, messages: list[dict], *, tools: list | None = None, **kwargs) -> str:
        """A chat-completions request's messages (and tools, and template variables), rendered."""
        payload = {"messages": messages, "tools": tools, **kwargs}
        if tools is None:
            del payload["tools"]
        return self.render(chat_inputs(payload, self.traits))

    def encode_text(self, text: str, known: tuple[str, int] | None = None) -> array:
        """Token ids of `text` with no added special tokens. The part a recent text shared up to one of its
        special tokens is taken from that text's ids (an agent's next turn re-sends the whole conversation);
        the rest comes from cached pieces where it repeats. `known`: a recent text and how many leading
        characters `text` is known to share with it (the render reused them), so they need no comparing."""
        if not self.special:
            return self._encode_pieces(text, 0, array("I"), [])
        head = text[:RECENT_HEAD]
        start, ids, marks = (known and self._known_prefix(head, *known)) or self._recent_prefix(head, text)
        ids = self._encode_pieces(text, start, ids, marks)
        group = self._recent.setdefault(head, [])
        group.append((text, ids, marks))
        self._recent_chars += len(text)
        if len(group) > RECENT_PER_HEAD:
            self._recent_chars -= len(group.pop(0)[0])
        self._recent.move_to_end(head)
        while self._recent_chars > RECENT_MAX_CHARS and len(self._recent) > 1:
            _, dropped = self._recent.popitem(last=False)
            self._recent_chars -= sum(len(entry[0]) for entry in dropped)
        return ids

    def _known_prefix(self, head: str, old_text: str, chars: int) -> tuple[int, array, list] | None:
        """The ids of `old_text` up to its last special token within its first `chars` characters."""
        for entry_text, old_ids, old_marks in self._recent.get(head, ()):
            if entry_text is old_text:
                found = bisect.bisect_right(old_marks, (chars, len(old_ids))) - 1
                if found < 0:
                    return None
                end, count = old_marks[found]
                return end, old_ids[:count], old_marks[: found + 1]
        return None

    def _recent_prefix(self, head: str, text: str) -> tuple[int, array, list]:
        """The longest run of `text`, ending just after a special token, that a recent text had too: where it
        ends, its ids and its marks (character end of each special token, ids so far). The pieces before such
        a point tokenise alike whatever follows it, since a special token always ends a piece."""
        best = (0, array("I"), [])
        for old_text, old_ids, old_marks in reversed(self._recent.get(head, ())):
            if not old_marks or old_marks[-1][0] <= best[0]:
                continue
            # Most often everything but the old text's generation prompt is shared: try its last marks first.
            found, quick = None, False
            for index in range(len(old_marks) - 1, max(len(old_marks) - 4, -1), -1):
                if old_marks[index][0] <= best[0]:
                    break
                if text.startswith(old_text[: old_marks[index][0]]):
                    found, quick = index, True
                    break
            if found is None:
                low, high = -1, len(old_marks) - 1  # mark `low` shared (or none), mark `high` not
                while low < high - 1:
                    middle = (low + high) // 2
                    if text.startswith(old_text[: old_marks[middle][0]]):
                        low = middle
                    else:
                        high = middle
                found = low if low >= 0 else None
            if found is not None and old_marks[found][0] > best[0]:
                end, count = old_marks[found]
                best = (end, old_ids[:count], old_marks[: found + 1])
            if quick:
                break
        return best

    def _encode_pieces(self, text: str, start: int, ids: array, marks: list) -> array:
        pieces = self._split.split(text[start:] if start else text) if self.special else [text]
        shared = self.shared
        if shared is not None:
            return self._encode_shared(shared, pieces, start, ids, marks)
        position = start
        for piece in pieces:
            if not piece:
                continue
            position += len(piece)
            special = self.special.get(piece)
            if special is not None:
                ids.append(special)
                marks.append((position, len(ids)))
                continue
            cached = self.cache.get(piece)
            if cached is None:
                cached = self.encode_piece(piece)
                self.cache.put(piece, cached)
            ids.extend(cached)
        return ids

    def _encode_shared(
        self, shared: SharedPieces, pieces: list[str], start: int, ids: array, marks: list
    ) -> array:
        """As `_encode_pieces`, with the pieces this tokenizer has not cached asked of the other replicas first
        (routing/rendering/shared_tokens.py), and the large ones it tokenises given to them."""
        special, cache = self.special, self.cache
        unseen = [p for p in pieces if p and p not in special and p not in cache]
        wanted = shared.wanted(unseen)
        if wanted:
            for piece, found in zip(wanted, shared.get_many(wanted), strict=True):
                if found is not None:
                    cache.put(piece, found, shared=True)
        new: dict[str, array] = {}
        position = start
        for piece in pieces:
            if not piece:
                continue
            position += len(piece)
            token = special.get(piece)
            if token is not None:
                ids.append(token)
                marks.append((position, len(ids)))
                continue
            cached = cache.get(piece)
            if cached is None:
                cached = self.encode_piece(piece)
                cache.put(piece, cached)
                if wanted and len(piece) >= shared.min_piece_chars:
                    new[piece] = cached
            ids.extend(cached)
        shared.put_many(new)
        return ids

    def encode_piece(self, piece: str) -> array:
        """The ids of a piece of text holding no special token (the text between two)."""
        if self.fast is not None:
            ids = self.fast.encode(piece)
            if ids is not None:
                return ids
        return array("I", self.tokenizer.encode(piece, add_special_tokens=False).ids)

    def encode_chat(self, messages: list[dict], **kwargs) -> array:
        return self.encode_text(self.render_chat(messages, **kwargs))

    def encode_request(self, payload: dict, path: str) -> array:
        """The prompt token ids the engine will compute for a chat or Anthropic messages request."""
        return self.encode_text(*self.render_prompt(payload, path))

    def encode_prompt(self, prompt: str) -> array:
        """A completions prompt, as the engine tokenises it (with the tokenizer's own special tokens)."""
        return array("I", self.tokenizer.encode(prompt, add_special_tokens=True).ids)


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _cut_at_tag(text: str, final: str) -> str:
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise RenderError(
            "continue_final_message", "the chat template drops part of the final message to continue"
        )
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    """The chat templates' tojson, as transformers defines it (not Jinja's HTML-escaping one)."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def rejects_inline_system(template: str | None) -> bool:
    """Whether the template refuses a system message after the first one (Qwen's templates raise on it); the
    engine then merges an Anthropic request's inline system messages into the leading one. Probed as vLLM
    probes it: a plain sandbox, no helpers, a system-user-system-user conversation."""
    if not template:
        return True
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def _is_multimodal(folder: Path) -> bool:
    """Whether the model takes images or audio: a vision or audio tower in its config, or a processor."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    towers = ("vision_config", "audio_config", "vision_tower", "mm_projector_type")
    return any(key in config for key in towers) or (folder / "preprocessor_config.json").exists()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value
