// Live traffic: one WebSocket, a snapshot per second, rendered as tables.
(function () {
  var root = document.getElementById("live");
  if (!root) return;
  var scheme = location.protocol === "https:" ? "wss://" : "ws://";
  var url = root.dataset.wsUrl;
  if (!url) url = scheme + location.host + "/ws/portal/live/";
  else if (url.charAt(0) === ":") url = scheme + location.hostname + url + "/ws/portal/live/";
  var state = document.getElementById("live-state");
  var columns = [["name", "Name"], ["rps", "Requests/s"], ["ttft_ms", "Mean TTFT ms"], ["input_tokens_per_s", "Input tok/s"],
    ["output_tokens_per_s", "Output tok/s"], ["prefix_hit_rate", "Prefix-hit rate"], ["errors", "Errors"], ["requests", "Requests"]];
  function fmt(v) { return v === null || v === undefined ? "–" : String(v); }
  function table(el, rows) {
    var head = "<thead><tr>" + columns.map(function (c) { return "<th>" + c[1] + "</th>"; }).join("") + "</tr></thead>";
    var body = rows.length ? rows.map(function (r) {
      return "<tr>" + columns.map(function (c) {
        var td = document.createElement("td"); td.textContent = fmt(r[c[0]]); td.dataset.col = c[0]; return td.outerHTML;
      }).join("") + "</tr>";
    }).join("") : '<tr><td colspan="8">No traffic.</td></tr>';
    el.innerHTML = head + "<tbody>" + body + "</tbody>";
  }
  function connect() {
    var ws = new WebSocket(url);
    ws.onopen = function () { state.textContent = "live"; };
    ws.onclose = function () { state.textContent = "reconnecting…"; setTimeout(connect, 2000); };
    ws.onmessage = function (msg) {
      var s = JSON.parse(msg.data);
      document.getElementById("live-window").textContent = s.window_s;
      var t = s.total;
      document.getElementById("live-total").innerHTML = '<div class="kpis">' + [["Requests/s", t.rps, "live-rps"], ["Mean TTFT ms", t.ttft_ms, "live-ttft"],
        ["Output tok/s", t.output_tokens_per_s, "live-otps"], ["Prefix-hit rate", t.prefix_hit_rate, "live-hit"], ["Errors", t.errors, "live-errors"],
        ["Requests", t.requests, "live-requests"]].map(function (k) {
        return '<div class="kpi"><b id="' + k[2] + '">' + fmt(k[1]) + "</b>" + k[0] + "</div>";
      }).join("") + "</div>";
      table(document.getElementById("live-deployments"), s.deployments);
      table(document.getElementById("live-tenants"), s.tenants);
    };
  }
  connect();
})();
