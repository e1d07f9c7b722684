// Deployment progress: poll the status endpoint while engines start, stop when all are healthy.
(function () {
  var box = document.getElementById("progress");
  if (!box) return;
  var url = box.dataset.statusUrl;
  function render(s) {
    document.getElementById("progress-bar").value = s.percent;
    var status = document.getElementById("progress-status");
    status.textContent = s.status;
    status.className = "status " + s.status;
    document.getElementById("progress-count").textContent = s.healthy + " of " + s.desired + " engines healthy" + (s.starting ? ", " + s.starting + " starting" : "");
    document.getElementById("progress-message").textContent = s.message || "";
    var list = document.getElementById("endpoint-list");
    list.replaceChildren.apply(list, s.endpoints.map(function (e) {
      var li = document.createElement("li");
      li.className = "health " + e.health;
      li.textContent = e.pool + "/" + e.name + " " + e.url + ": " + e.health;
      return li;
    }));
  }
  function tick() {
    fetch(url, { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(function (s) {
      render(s);
      var settled = s.status === "ready" || s.status === "stopped" || s.status === "failed";
      setTimeout(tick, settled ? 5000 : 1000);
    }).catch(function () { setTimeout(tick, 3000); });
  }
  tick();
})();
