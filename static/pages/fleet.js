/* Fleet page: heatmap with drill-down, capacity by type, nodes needing attention; live. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("fleet-data").textContent);
  var metricSelect = document.getElementById("metric");
  var heatmapDiv = document.getElementById("heatmap");
  var state = {draws: 0, data: data};
  window.meridianFleet = state;

  function pct(v) { return v === null || v === undefined ? "—" : Math.round(v * 100) + "%"; }
  function esc(s) { var d = document.createElement("div"); d.textContent = s == null ? "" : String(s); return d.innerHTML; }

  function drawHeatmap() {
    var h = data.heatmap;
    var metric = metricSelect.value;
    var cells = h.y.length * h.x.length;
    var trace = {
      type: "heatmap", z: h[metric], x: h.x, y: h.y, text: h.text,
      hovertemplate: "%{text}<br>" + (metric === "allocated" ? "allocated" : "used") + ": %{z:.0%}<extra></extra>",
      zmin: 0, zmax: 1, xgap: 2, ygap: 2, hoverongaps: false,
      colorscale: metric === "allocated" ? [[0, "#eef2fa"], [1, "#1d47b8"]] : [[0, "#eef7ef"], [1, "#1f6f3a"]],
      colorbar: {tickformat: ".0%", thickness: 12}
    };
    if (cells <= 128) { trace.texttemplate = "%{z:.0%}"; }
    var layout = {
      title: {text: h.title, font: {size: 14}},
      margin: {l: h.level === "fleet" ? 110 : 40, r: 10, t: 36, b: 30},
      height: Math.max(240, Math.min(720, 26 * h.y.length + 110)),
      xaxis: {type: "category", showticklabels: h.level === "fleet"},
      yaxis: {type: "category", autorange: "reversed", showticklabels: h.level === "fleet"}
    };
    Plotly.react(heatmapDiv, [trace], layout, {displayModeBar: false, responsive: true});
  }

  function drawBreadcrumbs() {
    var nav = document.getElementById("breadcrumbs");
    nav.innerHTML = data.heatmap.breadcrumbs.map(function (b, i, all) {
      var label = esc(b.label);
      return i === all.length - 1 ? "<strong>" + label + "</strong>" : '<a href="?' + esc(b.query) + '">' + label + "</a>";
    }).join(" › ");
  }

  function drawTotals() {
    var t = data.totals;
    document.getElementById("total-accelerators").textContent = t.accelerators;
    document.getElementById("total-allocated").textContent = t.allocated;
    document.getElementById("total-free").textContent = t.free;
    document.getElementById("total-nodes").textContent =
      t.nodes_by_state.ready + " / " + t.nodes_by_state.draining + " / " + t.nodes_by_state.lost;
  }

  function drawByType() {
    var types = data.by_type.map(function (r) { return r.type; });
    Plotly.react("by-type-chart", [
      {type: "bar", name: "allocated", x: types, y: data.by_type.map(function (r) { return r.allocated; }), marker: {color: "#2357d9"}},
      {type: "bar", name: "free", x: types, y: data.by_type.map(function (r) { return r.free; }), marker: {color: "#8fd19e"}},
      {type: "bar", name: "unavailable", x: types, y: data.by_type.map(function (r) { return r.unavailable; }), marker: {color: "#c9ced8"}}
    ], {barmode: "stack", height: 220, margin: {l: 50, r: 10, t: 10, b: 30}, legend: {orientation: "h"}},
    {displayModeBar: false, responsive: true});
    document.querySelector("#by-type-table tbody").innerHTML = data.by_type.map(function (r) {
      return "<tr><td>" + esc(r.type) + "</td><td>" + r.accelerators + "</td><td>" + r.allocated + "</td><td>" + r.free +
        "</td><td>" + r.unavailable + "</td><td>" + pct(r.allocated_fraction) + "</td><td>" + pct(r.used_fraction) + "</td></tr>";
    }).join("") || '<tr><td colspan="7" class="muted">No accelerators registered.</td></tr>';
  }

  function drawAttention() {
    document.getElementById("attention-total").textContent = "(" + data.attention_total + ")";
    document.querySelector("#attention-table tbody").innerHTML = data.attention.map(function (n) {
      return '<tr><td><a href="?node=' + n.id + '">' + esc(n.hostname) + "</a></td><td>" + esc(n.cluster__region__name + "/" + n.cluster__name) +
        '</td><td><span class="state state-' + esc(n.state) + '">' + esc(n.state) + "</span></td><td>" + esc(n.last_heartbeat || "never") + "</td></tr>";
    }).join("") || '<tr><td colspan="4" class="muted">All nodes are ready.</td></tr>';
  }

  // Utilization over time for the level shown (fleet, cluster or node). The page's own JSON
  // carries the default window; other windows come from the API for the same scope.
  var historyWindow = document.getElementById("history-window");
  var DEFAULT_HISTORY_HOURS = "6";
  var history = data.utilization_history;

  function historyApiUrl() {
    var query = "hours=" + historyWindow.value + (history.scope_query ? "&" + history.scope_query : "");
    return "/api/fleet/utilization/?" + query;
  }

  function fetchHistory() {
    if (historyWindow.value === DEFAULT_HISTORY_HOURS) {
      history = data.utilization_history;
      return Promise.resolve();
    }
    return MeridianLive.fetchJson(historyApiUrl()).then(function (body) {
      history = {points: body.points, since: body.since, until: body.until, resolution_seconds: body.resolution_seconds,
                 scope_query: data.utilization_history.scope_query};
    });
  }

  function drawHistory() {
    var points = history.points;
    var times = points.map(function (p) { return p.t; });
    var mode = points.length < 30 ? "lines+markers" : "lines";  // a few points are invisible as bare lines
    document.getElementById("history-empty").hidden = points.length > 0;
    document.getElementById("history-scope").textContent =
      "(" + data.heatmap.breadcrumbs[data.heatmap.breadcrumbs.length - 1].label + ", " +
      (history.resolution_seconds === 60 ? "per minute" : "per hour") + ")";
    Plotly.react("history-chart", [
      {type: "scatter", mode: mode, name: "mean utilization", x: times,
       y: points.map(function (p) { return p.utilization_mean; }), line: {color: "#1f6f3a", width: 2}},
      {type: "scatter", mode: mode, name: "busiest device", x: times,
       y: points.map(function (p) { return p.utilization_max; }), line: {color: "#8fd19e", width: 1, dash: "dot"}},
      {type: "scatter", mode: mode, name: "memory used per device (GB)", x: times, yaxis: "y2",
       y: points.map(function (p) { return p.memory_used_gb_mean; }), line: {color: "#2357d9", width: 1}}
    ], {
      height: 240, margin: {l: 50, r: 50, t: 10, b: 30}, legend: {orientation: "h"},
      xaxis: {type: "date", range: [history.since, history.until]},
      yaxis: {tickformat: ".0%", range: [0, 1.05], title: {text: "utilization"}},
      yaxis2: {overlaying: "y", side: "right", rangemode: "tozero", title: {text: "GB"}, showgrid: false}
    }, {displayModeBar: false, responsive: true});
  }

  function drawAll() {
    drawHeatmap(); drawBreadcrumbs(); drawTotals(); drawByType(); drawAttention(); drawHistory();
    state.draws += 1;
    state.data = data;
    document.body.dataset.fleetRenderedAt = String(Date.now());
  }

  metricSelect.addEventListener("change", drawHeatmap);
  historyWindow.addEventListener("change", function () { fetchHistory().then(drawHistory); });
  drawAll();
  heatmapDiv.on("plotly_click", function (event) {
    var point = event.points && event.points[0];
    if (!point || !data.heatmap.drill) { return; }
    var index = point.pointIndex || point.pointNumber;  // [row, column]
    var id = data.heatmap.ids[index[0]][index[1]];
    if (id !== null && id !== undefined) { location.search = "?" + data.heatmap.drill + "=" + id; }
  });

  var refresh = MeridianLive.refresher(function () {
    return MeridianLive.fetchJson(MeridianLive.withParam(location.href, "format", "json")).then(function (fresh) {
      data = fresh;
      return fetchHistory();
    }).then(drawAll);
  });
  // Telemetry (actually-used) arrives continuously from the agents and is not pushed
  // message by message; a visible fleet page also refetches on this slow beat.
  var TELEMETRY_REFRESH_MS = 15000;
  setInterval(function () { if (document.visibilityState === "visible") { refresh(); } }, TELEMETRY_REFRESH_MS);
  // Draining asks first (here, not inline: the Content-Security-Policy allows no inline script).
  var drainForm = document.getElementById("drain-form");
  if (drainForm) {
    drainForm.addEventListener("submit", function (event) {
      if (!window.confirm(drainForm.dataset.confirm)) { event.preventDefault(); }
    });
  }
  MeridianLive.start(["fleet"], function (message) {
    if (message.type === "subscribed" || message.type === "fleet.changed" || message.type === "jobs.job_updated") { refresh(); }
  });
})();
