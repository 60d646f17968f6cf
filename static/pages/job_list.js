/* Jobs list: the rows refresh in place when a job of one of your teams changes. */
(function () {
  "use strict";
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
