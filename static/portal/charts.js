// The portal's charts, drawn with uPlot (static/vendor/uplot-*, served from here like everything else).
//
// A `.history` box fetches its series from the history endpoint (portal/charts.py says what comes back) for the
// period its buttons pick, and draws one chart per entry, a line per series; `data-refresh` redraws it every so
// many seconds (the live page). A `.report-days` box draws the same shape from a JSON script on the page. Each
// chart is kept in window.portalCharts under "<box id>:<chart id>", and its figure says how many points it has.
(function () {
  if (!window.uPlot) return;
  var f = window.figures;
  var registry = window.portalCharts = {};
  var COLOURS = ["#2f5bd3", "#d97706", "#059669", "#b42318", "#7c3aed", "#0891b2", "#be185d", "#4d7c0f"];
  var compactForm = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });
  var PERIOD_TEXT = { hour: "the last hour, a point per minute", day: "the last 24 hours, a point per minute",
    week: "the last 7 days, a point per hour", month: "the last 30 days, a point per hour" };

  function missing(v) { return v === null || v === undefined || isNaN(v); }
  function compact(v) { return missing(v) ? "–" : compactForm.format(v); }
  function money(currency) {
    var exact = new Intl.NumberFormat("en-US", { style: "currency", currency: currency });
    var short = new Intl.NumberFormat("en-US", { style: "currency", currency: currency, notation: "compact",
      maximumFractionDigits: 1 });
    return function (v) { return missing(v) ? "–" : (Math.abs(v) >= 10000 ? short : exact).format(v); };
  }
  // How a value of each unit reads on an axis (the chart's title says "per minute").
  function axisFormatter(unit) {
    if (unit === "per_min" || unit === "tokens_per_min" || unit === "tokens") return compact;
    return formatter(unit);
  }
  // How a value of each unit reads in the legend.
  function formatter(unit) {
    if (unit.indexOf("money:") === 0) return money(unit.slice(6));
    return {
      per_min: function (v) { return missing(v) ? "–" : compact(v) + "/min"; },
      tokens_per_min: function (v) { return missing(v) ? "–" : compact(v) + " tok/min"; },
      ms: f.duration,
      ratio: f.percent,
      replicas: f.rate,
      requests: f.rate,
      tokens: compact
    }[unit] || f.rate;
  }

  function options(chart, width) {
    var units = [];
    chart.series.forEach(function (s) { if (units.indexOf(s.unit) < 0) units.push(s.unit); });
    var axes = [{}];
    units.slice(0, 2).forEach(function (unit, i) {
      var fmt = axisFormatter(unit);
      axes.push({ scale: unit, side: i === 0 ? 3 : 1, size: 64, grid: { show: i === 0 },
        values: function (u, splits) { return splits.map(fmt); } });
    });
    var scales = { x: { time: true } };
    units.forEach(function (unit) { scales[unit] = unit === "ratio" ? { range: [0, 1] } : { range: function (u, min, max) { return [0, max > 0 ? max * 1.1 : 1]; } }; });
    var opts = {
      width: width, height: 240, scales: scales, axes: axes,
      legend: { live: true },
      series: [{ value: function (u, ts) { return ts === null ? "–" : new Date(ts * 1000).toLocaleString(); } }].concat(
        chart.series.map(function (s, i) {
          var colour = COLOURS[i % COLOURS.length];
          var line = { label: s.label, scale: s.unit, stroke: colour, width: s.dash ? 1.5 : 2,
            value: (function (fmt) { return function (u, v) { return fmt(v); }; })(formatter(s.unit)),
            points: { show: false }, spanGaps: true };
          if (s.dash) line.dash = [6, 4];
          if (chart.bars) { line.paths = uPlot.paths.bars({ size: [0.6, 40] }); line.fill = colour + "99"; }
          return line;
        }))
    };
    if (chart.utc) opts.tzDate = function (ts) { return uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"); };
    return opts;
  }

  function draw(box, data) {
    var grid = box.querySelector(".charts");
    Object.keys(registry).forEach(function (key) {
      if (key.indexOf(box.id + ":") === 0) { registry[key].destroy(); delete registry[key]; }
    });
    // Every figure in the grid first, so that each chart is sized to its own cell.
    grid.replaceChildren.apply(grid, data.charts.map(function (chart) {
      var figure = document.createElement("figure");
      figure.className = "history-chart";
      figure.dataset.chart = chart.id;
      figure.dataset.points = data.t.length;
      var caption = document.createElement("figcaption");
      caption.textContent = chart.title;
      figure.appendChild(caption);
      return figure;
    }));
    data.charts.forEach(function (chart, i) {
      var figure = grid.children[i];
      var width = Math.max(figure.clientWidth - 16, 280);
      var u = new uPlot(options(chart, width), [data.t].concat(chart.series.map(function (s) { return s.values; })), figure);
      registry[box.id + ":" + chart.id] = u;
    });
    box.dataset.drawn = (Number(box.dataset.drawn) || 0) + 1;
  }

  function load(box) {
    var period = box.dataset.period;
    box.querySelectorAll("button.period").forEach(function (b) {
      var on = b.dataset.period === period;
      b.classList.toggle("active", on);
      b.setAttribute("aria-pressed", on ? "true" : "false");
    });
    var state = box.querySelector(".history-state");
    return fetch(box.dataset.url + "&period=" + encodeURIComponent(period), { credentials: "same-origin",
      headers: { Accept: "application/json" } }).then(function (r) {
      if (!r.ok) throw new Error(r.status + " " + r.statusText);
      return r.json();
    }).then(function (data) {
      if (data.period !== box.dataset.period) return;  // another period was picked meanwhile
      draw(box, data);
      if (state) state.textContent = "Over " + PERIOD_TEXT[data.period] + "; counts per minute, spend from the period's start. Times in your timezone.";
    }).catch(function (e) { if (state) state.textContent = "Could not load the history: " + e.message; });
  }

  document.querySelectorAll(".history[data-url]").forEach(function (box) {
    box.querySelectorAll("button.period").forEach(function (b) {
      b.addEventListener("click", function () { box.dataset.period = b.dataset.period; load(box); });
    });
    load(box);
    var every = Number(box.dataset.refresh);
    if (every > 0) setInterval(function () { load(box); }, every * 1000);
  });
  document.querySelectorAll(".report-days[data-source]").forEach(function (box) {
    draw(box, JSON.parse(document.getElementById(box.dataset.source).textContent));
  });
  var resizing;
  window.addEventListener("resize", function () {
    clearTimeout(resizing);
    resizing = setTimeout(function () {
      Object.keys(registry).forEach(function (key) {
        var u = registry[key];
        u.setSize({ width: Math.max(u.root.parentNode.clientWidth - 16, 280), height: 240 });
      });
    }, 150);
  });
})();
