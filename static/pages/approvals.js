/* Approvals: pending requests and the audit trail refresh in place on any change. */
(function () {
  "use strict";
  var box = document.getElementById("approvals-tables");
  var teamIds = (box.dataset.teamIds || "").split(",").filter(Boolean);
  // A note being typed, or typed and not yet sent (the click on Approve takes the focus away from
  // it), must not be wiped by a refresh: wait for the next push after the decision is sent.
  function noteInProgress() {
    var active = document.activeElement;
    if (box.contains(active) && active.tagName === "TEXTAREA") { return true; }
    return Array.prototype.some.call(box.querySelectorAll("textarea"), function (t) { return t.value.trim() !== ""; });
  }
  var refresh = MeridianLive.refresher(function () {
    if (noteInProgress()) { return null; }
    return MeridianLive.fetchText(MeridianLive.withParam(location.href, "fragment", "rows")).then(function (html) {
      // checked again: the rows were fetched while the person may have started typing
      if (noteInProgress()) { return; }
      box.innerHTML = html;
      document.body.dataset.approvalsRenderedAt = String(Date.now());
    });
  });
  var groups = ["approvals"].concat(teamIds.map(function (id) { return "team." + id; }));
  MeridianLive.start(groups, function (message) {
    if (message.type === "subscribed" || message.type === "jobs.preemption_updated" || message.type === "jobs.job_updated") { refresh(); }
  });
})();
