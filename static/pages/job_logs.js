/* Job page: the live tail of one rank's log. Opens on the newest chunks, then follows the
 * cursor (GET /api/jobs/<id>/logs/?rank=&after=) on every "jobs.log_appended" push and after
 * every (re)subscription; fetches coalesce (MeridianLive.refresher). Markers (preemptions,
 * moves, resizes) and "bytes dropped" notes are shown in colour. */
window.MeridianJobLogs = (function () {
  "use strict";
  var pre = document.getElementById("job-log");
  if (!pre) { return null; }
  var jobId = pre.dataset.jobId;
  var select = document.getElementById("log-rank");
  var follow = document.getElementById("log-follow");
  var state = {rank: select ? select.value : "0", after: 0, loaded: false, chunks: 0, lastSeq: 0};
  var MAX_CHUNKS_SHOWN = 2000;

  function url(tail) {
    var u = "/api/jobs/" + jobId + "/logs/?rank=" + encodeURIComponent(state.rank) + "&limit=500";
    return u + (tail ? "&tail=1" : "&after=" + state.after);
  }

  function append(chunks) {
    chunks.forEach(function (chunk) {
      var span = document.createElement("span");
      span.className = chunk.kind + (chunk.stream ? " " + chunk.stream : "");
      span.dataset.seq = String(chunk.seq);
      span.textContent = chunk.text;
      pre.appendChild(span);
      state.chunks += 1;
    });
    while (pre.childNodes.length > MAX_CHUNKS_SHOWN) { pre.removeChild(pre.firstChild); }
    if (chunks.length) {
      state.lastSeq = chunks[chunks.length - 1].seq;
      pre.dataset.lastSeq = String(state.lastSeq);
      pre.dataset.renderedAt = String(Date.now());
      if (!follow || follow.checked) { pre.scrollTop = pre.scrollHeight; }
    }
  }

  var fetchMore = MeridianLive.refresher(function () {
    var first = !state.loaded;
    var rank = state.rank;
    return MeridianLive.fetchJson(url(first)).then(function (answer) {
      if (rank !== state.rank) { return; }  // the rank changed while this was in flight
      state.loaded = true;
      append(answer.chunks);
      state.after = answer.next;
      if (answer.chunks.length === 500 && !first) { fetchMore(); }  // more than one page behind
    });
  });

  if (select) {
    select.addEventListener("change", function () {
      state = {rank: select.value, after: 0, loaded: false, chunks: 0, lastSeq: 0};
      pre.textContent = "";
      fetchMore();
    });
  }
  fetchMore();

  return {
    state: function () { return state; },
    onMessage: function (message) {
      if (message.type === "subscribed" || message.type === "jobs.log_appended") { fetchMore(); }
    }
  };
})();
