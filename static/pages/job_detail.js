/* Job detail: state, progress, Gantt timeline and events, refreshed in place on pushes. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("job-data").textContent);
  var jobId = data.job.id;
  var state = {draws: 0, data: data};
  window.meridianJob = state;

  function drawGantt() {
    var segments = data.timeline.segments;
    var bars = {
      type: "bar", orientation: "h",
      base: segments.map(function (s) { return s.start; }),
      x: segments.map(function (s) { return Math.max(new Date(s.end) - new Date(s.start), 500); }),
      y: segments.map(function (s) { return s.lane; }),
      text: segments.map(function (s) { return s.label; }),
      textposition: "inside", insidetextanchor: "start", textangle: 0,
      marker: {color: segments.map(function (s) { return s.color; })},
      hovertemplate: "%{text}<br>%{base|%H:%M:%S} → +%{x}ms<extra></extra>"
    };
    var markers = data.timeline.markers;
    var points = {
      type: "scatter", mode: "markers", name: "events",
      x: markers.map(function (m) { return m.at; }),
      y: markers.map(function () { return "events"; }),
      text: markers.map(function (m) { return m.label; }),
      marker: {symbol: "diamond", size: 10, color: "#1d2330"},
      hovertemplate: "%{text}<br>%{x|%H:%M:%S}<extra></extra>"
    };
    Plotly.react("gantt", [bars, points], {
      height: 200, showlegend: false, margin: {l: 80, r: 10, t: 10, b: 30},
      xaxis: {type: "date"}, yaxis: {type: "category", categoryorder: "array", categoryarray: ["events", "placement", "state"]}
    }, {displayModeBar: false, responsive: true});
  }

  function drawState() {
    var badge = document.getElementById("job-state");
    badge.textContent = data.job.state;
    badge.className = "state state-" + data.job.state;
    badge.dataset.renderedAt = String(Date.now());
    var cancel = document.getElementById("cancel-form");
    if (cancel && data.job.is_terminal) { cancel.remove(); }
  }

  // The cancel form asks first (here, not in an inline onsubmit: the Content-Security-Policy
  // allows no inline script).
  var cancelForm = document.getElementById("cancel-form");
  if (cancelForm) {
    cancelForm.addEventListener("submit", function (event) {
      if (!window.confirm(cancelForm.dataset.confirm)) { event.preventDefault(); }
    });
  }

  function drawAll() { drawState(); drawGantt(); state.draws += 1; state.data = data; }
  drawAll();

  var refresh = MeridianLive.refresher(function () {
    return MeridianLive.fetchJson(MeridianLive.withParam(location.href, "format", "json")).then(function (fresh) {
      data = fresh;
      document.getElementById("job-summary").innerHTML = fresh.summary_html;
      document.getElementById("job-events").innerHTML = fresh.events_html;
      drawAll();
    });
  });
  MeridianLive.start(["job." + jobId], function (message) {
    if (message.type === "subscribed" || message.type === "jobs.job_updated" || message.type === "jobs.preemption_updated") { refresh(); }
  });
})();
