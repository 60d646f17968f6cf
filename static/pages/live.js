/* Meridian live updates: one WebSocket per page (ws/live/), joined to the groups the
 * page needs. Pages pass a handler; after the server confirms the subscription (and
 * after every reconnect) the handler gets {type: "subscribed"} so the page refetches
 * whatever changed while it was not listening. */
window.MeridianLive = (function () {
  "use strict";
  var groups = [];
  var handlers = [];
  var retryMs = 500;
  var log = [];  // every message with the browser time it arrived (for latency checks)

  function setStatus(state) {
    var el = document.getElementById("live-status");
    if (el) { el.dataset.state = state; el.title = "live updates: " + state; }
    document.body.dataset.live = state;
  }

  function connect() {
    var scheme = location.protocol === "https:" ? "wss" : "ws";
    var socket = new WebSocket(scheme + "://" + location.host + "/ws/live/");
    socket.onopen = function () {
      retryMs = 500;
      socket.send(JSON.stringify({subscribe: groups}));
    };
    socket.onmessage = function (event) {
      var message = JSON.parse(event.data);
      message.receivedAt = Date.now();
      log.push({type: message.type, receivedAt: message.receivedAt});
      if (log.length > 500) { log.shift(); }
      if (message.type === "subscribed") { setStatus("subscribed"); }
      handlers.forEach(function (handler) { handler(message); });
    };
    socket.onclose = function (event) {
      setStatus("offline");
      if (event.code === 4401) { return; }  // not logged in: reconnecting will not help
      setTimeout(connect, retryMs);          // back off, never a tight loop
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }

  function start(pageGroups, handler) {
    groups = pageGroups;
    handlers.push(handler);
    setStatus("connecting");
    connect();
  }

  /* Returns a function that runs `fetchAndApply` with at most one run in flight; a call
   * during a run schedules exactly one more run after it (pushes coalesce, none is lost). */
  function refresher(fetchAndApply) {
    var running = false, again = false;
    function run() {
      if (running) { again = true; return; }
      running = true;
      Promise.resolve().then(fetchAndApply).catch(function (error) {
        console.error("live refresh failed", error);
      }).then(function () {
        running = false;
        if (again) { again = false; run(); }
      });
    }
    return run;
  }

  function fetchJson(url) {
    return fetch(url, {credentials: "same-origin", headers: {"Accept": "application/json"}}).then(function (r) {
      if (!r.ok) { throw new Error(url + " answered " + r.status); }
      return r.json();
    });
  }

  function fetchText(url) {
    return fetch(url, {credentials: "same-origin"}).then(function (r) {
      if (!r.ok) { throw new Error(url + " answered " + r.status); }
      return r.text();
    });
  }

  function withParam(url, key, value) {
    var u = new URL(url, location.href);
    u.searchParams.set(key, value);
    return u.pathname + u.search;
  }

  return {start: start, refresher: refresher, fetchJson: fetchJson, fetchText: fetchText, withParam: withParam, log: log};
})();
