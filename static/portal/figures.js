// Figures as people read them, in the browser: the same forms as the pages' template filters
// (portal/templatetags/figures.py), for what scripts draw (the live page), and times in the viewer's timezone.
(function () {
  var NONE = "–";
  var counts = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  var tenths = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  var upToTenths = new Intl.NumberFormat("en-US", { maximumFractionDigits: 1 });
  function missing(v) { return v === null || v === undefined || v === "" || isNaN(Number(v)); }
  // 45602087 -> 45,602,087
  function count(v) { return missing(v) ? NONE : counts.format(Number(v)); }
  // 12.345 -> 12.3; 2 -> 2
  function rate(v) { return missing(v) ? NONE : upToTenths.format(Number(v)); }
  // 0.379 -> 37.9%
  function percent(v) { return missing(v) ? NONE : tenths.format(Number(v) * 100) + "%"; }
  // Milliseconds: 350 -> 350 ms; 1234 -> 1.2 s; 150000 -> 2.5 min
  function duration(ms) {
    if (missing(ms)) return NONE;
    ms = Number(ms);
    if (Math.abs(ms) < 1000) return counts.format(ms) + " ms";
    if (Math.abs(ms) < 60000) return tenths.format(ms / 1000) + " s";
    if (Math.abs(ms) < 3600000) return tenths.format(ms / 60000) + " min";
    return tenths.format(ms / 3600000) + " h";
  }

  // Each <time data-local> holds an instant in UTC (its title says it in UTC): its text becomes the viewer's own
  // time, written as the page writes UTC ("2026-12-04 15:12 CET").
  function pad(n) { return (n < 10 ? "0" : "") + n; }
  function zone(d) {
    try {
      var parts = new Intl.DateTimeFormat(undefined, { timeZoneName: "short" }).formatToParts(d);
      var name = parts.filter(function (p) { return p.type === "timeZoneName"; })[0];
      return name ? " " + name.value : "";
    } catch (e) {
      return "";
    }
  }
  function local(d, precision) {
    var text = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + pad(d.getHours()) +
      ":" + pad(d.getMinutes());
    return text + (precision === "seconds" ? ":" + pad(d.getSeconds()) : "") + zone(d);
  }
  function localTimes(root) {
    (root || document).querySelectorAll("time[data-local]").forEach(function (el) {
      var d = new Date(el.getAttribute("datetime"));
      if (!isNaN(d.getTime())) el.textContent = local(d, el.dataset.local);
    });
  }

  window.figures = { count: count, rate: rate, percent: percent, duration: duration, localTimes: localTimes };
  localTimes(document);
})();
