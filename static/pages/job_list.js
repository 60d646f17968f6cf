/* Jobs list: the rows refresh in place when a job of one of your teams changes. */
(function () {
  "use strict";
  // A filter applies as soon as it is chosen (here, not in an inline onchange: the
  // Content-Security-Policy allows no inline script).
  Array.prototype.forEach.call(document.querySelectorAll("select[data-submit-on-change]"), function (select) {
    select.addEventListener("change", function () { select.form.submit(); });
  });
  var table = document.getElementById("jobs-table");
  var teamIds = (table.dataset.teamIds || "").split(",").filter(Boolean);
  var refresh = MeridianLive.refresher(function () {
    return MeridianLive.fetchText(MeridianLive.withParam(location.href, "fragment", "rows")).then(function (html) {
      document.getElementById("jobs-rows").innerHTML = html;
      document.body.dataset.rowsRenderedAt = String(Date.now());
    });
  });
  MeridianLive.start(teamIds.map(function (id) { return "team." + id; }), function (message) {
    if (message.type === "subscribed" || message.type === "jobs.job_updated") { refresh(); }
  });
})();
