// idemq dashboard: the live throughput chart and confirmations for
// destructive actions. No user data is ever inlined into this file: the
// chart reads /dashboard/stats.json, a JSON document parsed with JSON.
"use strict";

// Forms with data-confirm ask before they post (purge).
document.addEventListener("submit", function (ev) {
  var form = ev.target;
  var msg = form.getAttribute && form.getAttribute("data-confirm");
  if (msg && !window.confirm(msg)) { ev.preventDefault(); }
});

(function () {
  var canvas = document.getElementById("throughput");
  if (!canvas) { return; }
  var MAX_POINTS = 90; // three minutes at one sample every 2 s
  var samples = [];    // {t, enq, done, dead}: rates per second
  var last = null;
  var rateNow = document.getElementById("rate-now");

  function draw() {
    var dpr = window.devicePixelRatio || 1;
    var w = canvas.clientWidth, h = canvas.clientHeight;
    canvas.width = w * dpr; canvas.height = h * dpr;
    var ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    ctx.clearRect(0, 0, w, h);
    var pad = { l: 44, r: 8, t: 8, b: 18 };
    var max = 1;
    samples.forEach(function (s) { max = Math.max(max, s.enq, s.done, s.dead); });
    max = Math.ceil(max * 1.15);
    ctx.strokeStyle = "#e2e5eb"; ctx.fillStyle = "#6b7385"; ctx.lineWidth = 1;
    ctx.font = "11px system-ui, sans-serif";
    for (var i = 0; i <= 4; i++) {
      var y = pad.t + (h - pad.t - pad.b) * i / 4;
      ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
      ctx.fillText(String(Math.round(max * (4 - i) / 4 * 10) / 10), 4, y + 4);
    }
    ctx.fillText("−3 min", pad.l, h - 4);
    ctx.fillText("now", w - pad.r - 22, h - 4);
    var css = getComputedStyle(document.documentElement);
    // Enqueued is dashed and drawn last: in a steady state it lies on top
    // of completed, and both stay visible.
    [["done", "--completed", []], ["dead", "--dead", []], ["enq", "--accent", [6, 4]]].forEach(function (series) {
      ctx.strokeStyle = css.getPropertyValue(series[1]).trim() || "#333";
      ctx.setLineDash(series[2]);
      ctx.lineWidth = 2; ctx.beginPath();
      samples.forEach(function (s, idx) {
        var x = pad.l + (w - pad.l - pad.r) * (MAX_POINTS - samples.length + idx) / (MAX_POINTS - 1);
        var y = h - pad.b - (h - pad.t - pad.b) * s[series[0]] / max;
        if (idx === 0) { ctx.moveTo(x, y); } else { ctx.lineTo(x, y); }
      });
      ctx.stroke();
    });
    if (samples.length === 0) {
      ctx.fillStyle = "#6b7385";
      ctx.fillText("collecting samples…", w / 2 - 50, h / 2);
    }
  }

  function updateCounters(totals, estimated) {
    var els = document.querySelectorAll("[data-total]");
    for (var i = 0; i < els.length; i++) {
      var k = els[i].getAttribute("data-total");
      if (Object.prototype.hasOwnProperty.call(totals, k)) {
        els[i].textContent = (estimated.indexOf(k) >= 0 ? "\u2248" : "") + String(totals[k]);
      }
    }
  }

  function poll() {
    fetch("/dashboard/stats.json", { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (s) {
        var now = { t: Date.parse(s.at), jobs: s.jobs, done: s.totals.completed, dead: s.totals.dead };
        if (last && now.t > last.t) {
          var dt = (now.t - last.t) / 1000;
          // Purges and retention make totals dip: a dip is no negative rate.
          samples.push({
            enq: Math.max(0, now.jobs - last.jobs) / dt,
            done: Math.max(0, now.done - last.done) / dt,
            dead: Math.max(0, now.dead - last.dead) / dt
          });
          if (samples.length > MAX_POINTS) { samples.shift(); }
          var cur = samples[samples.length - 1];
          if (rateNow) {
            rateNow.textContent = "— now: " + cur.enq.toFixed(1) + " enqueued/s, " +
              cur.done.toFixed(1) + " completed/s";
          }
        }
        last = now;
        updateCounters(s.totals, s.estimated || []);
        draw();
      })
      .catch(function () { /* the next poll tries again */ });
  }

  draw();
  poll();
  setInterval(poll, 2000);
  window.addEventListener("resize", draw);
})();
