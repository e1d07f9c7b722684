// Live traffic: one WebSocket, a snapshot per second, rendered as tables.
(function () {
  var root = document.getElementById("live");
  if (!root) return;
  var scheme = location.protocol === "https:" ? "wss://" : "ws://";
  var url = root.dataset.wsUrl;
  if (!url) url = scheme + location.host + "/ws/portal/live/";
  else if (url.charAt(0) === ":") url = scheme + location.hostname + url + "/ws/portal/live/";
  var state = document.getElementById("live-state");
  var columns = [["name", "Name"], ["rps", "Requests/s"], ["ttft_ms", "Mean TTFT"], ["input_tokens_per_s", "Input tok/s"],
    ["output_tokens_per_s", "Output tok/s"], ["prefix_hit_rate", "Prefix-hit rate"], ["errors", "Errors"], ["requests", "Requests"]];
  // Per deployment also flow control: saturated (by any router), and the requests waiting in the routers now.
  var deploymentColumns = columns.concat([["saturated", "Saturated"], ["queued", "Queued"]]);
  // Flow control per deployment, priority class and tenant: waiting now, and over the window.
  var flowColumns = [["deployment", "Deployment"], ["priority_class", "Class"], ["tenant", "Tenant"], ["queued", "Queued"],
    ["dispatches", "Dispatches"], ["rejected", "Rejected (429)"], ["wait_ms_mean", "Mean wait"], ["wait_ms_p90", "p90 wait"],
    ["wait_ms_max", "Max wait"]];
  // How each column's figures read (static/portal/figures.js); names and classes as they are.
  var f = window.figures;
  var formats = {rps: f.rate, ttft_ms: f.duration, input_tokens_per_s: f.count, output_tokens_per_s: f.count,
    prefix_hit_rate: f.percent, errors: f.count, requests: f.count, queued: f.count, dispatches: f.count,
    rejected: f.count, wait_ms_mean: f.duration, wait_ms_p90: f.duration, wait_ms_max: f.duration};
  function fmt(v, col) {
    if (v === true) return "yes";
    if (v === false) return "no";
    if (v === null || v === undefined) return "–";
    return formats[col] ? formats[col](v) : String(v);
  }
  function table(el, rows, cols, empty) {
    cols = cols || columns;
    var head = "<thead><tr>" + cols.map(function (c) { return "<th>" + c[1] + "</th>"; }).join("") + "</tr></thead>";
    var body = rows.length ? rows.map(function (r) {
      return "<tr>" + cols.map(function (c) {
        var td = document.createElement("td"); td.textContent = fmt(r[c[0]], c[0]); td.dataset.col = c[0]; return td.outerHTML;
      }).join("") + "</tr>";
    }).join("") : '<tr><td colspan="' + cols.length + '">' + (empty || "No traffic.") + "</td></tr>";
    el.innerHTML = head + "<tbody>" + body + "</tbody>";
  }
  function flowRows(deployments) {
    var rows = [];
    deployments.forEach(function (d) {
      (d.flow || []).forEach(function (f) { rows.push(Object.assign({deployment: d.name}, f)); });
    });
    return rows;
  }
  function connect() {
    var ws = new WebSocket(url);
    ws.onopen = function () { state.textContent = "live"; };
    ws.onclose = function (event) {
      // 4401: signed out, or the single sign-on check is due; only a page load can go to the identity provider.
      if (event.code === 4401) { state.textContent = "signing in again…"; location.reload(); return; }
      state.textContent = "reconnecting…"; setTimeout(connect, 2000);
    };
    ws.onmessage = function (msg) {
      var s = JSON.parse(msg.data);
      document.getElementById("live-window").textContent = s.window_s;
      var t = s.total;
      document.getElementById("live-total").innerHTML = '<div class="kpis">' + [["Requests/s", t.rps, "live-rps", "rps"],
        ["Mean TTFT", t.ttft_ms, "live-ttft", "ttft_ms"], ["Output tok/s", t.output_tokens_per_s, "live-otps", "output_tokens_per_s"],
        ["Prefix-hit rate", t.prefix_hit_rate, "live-hit", "prefix_hit_rate"], ["Errors", t.errors, "live-errors", "errors"],
        ["Requests", t.requests, "live-requests", "requests"]].map(function (k) {
        return '<div class="kpi"><b id="' + k[2] + '">' + fmt(k[1], k[3]) + "</b>" + k[0] + "</div>";
      }).join("") + "</div>";
      table(document.getElementById("live-deployments"), s.deployments, deploymentColumns);
      table(document.getElementById("live-flow"), flowRows(s.deployments), flowColumns, "Nothing queued or prioritised.");
      table(document.getElementById("live-tenants"), s.tenants);
    };
  }
  connect();
})();
