/* Approvals: pending requests and the audit trail refresh in place on any change. */
(function () {
  "use strict";
  var box = document.getElementById("approvals-tables");
  var teamIds = (box.dataset.teamIds || "").split(",").filter(Boolean);
  var refresh = MeridianLive.refresher(function () {
    // Do not wipe a note someone is typing: wait for the next push after they finish.
    if (box.contains(document.activeElement) && document.activeElement.tagName === "TEXTAREA") { return null; }
    return MeridianLive.fetchText(MeridianLive.withParam(location.href, "fragment", "rows")).then(function (html) {
      box.innerHTML = html;
      document.body.dataset.approvalsRenderedAt = String(Date.now());
    });
  });
  var groups = ["approvals"].concat(teamIds.map(function (id) { return "team." + id; }));
  MeridianLive.start(groups, function (message) {
    if (message.type === "subscribed" || message.type === "jobs.preemption_updated" || message.type === "jobs.job_updated") { refresh(); }
  });
})();
