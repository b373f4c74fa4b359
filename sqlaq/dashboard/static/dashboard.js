/* sqlaq dashboard: the overview's plots (uPlot) and its refresh (fetch of the JSON
   endpoint every few seconds; tables come back as server-rendered, escaped HTML). */
(function () {
  "use strict";
  var main = document.getElementById("overview");
  var source = document.getElementById("overview-data");
  if (!main || !source || typeof uPlot === "undefined") return;

  var api = main.getAttribute("data-api");
  var refresh = Math.max(1, parseFloat(main.getAttribute("data-refresh")) || 5) * 1000;
  var state = { charts: {}, refreshes: 0, failures: 0 };
  window.sqlaqDashboard = state;

  function utc(ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); }

  function stamp(seconds) {
    return new Date(seconds * 1000).toISOString().slice(0, 19).replace("T", " ");
  }

  var specs = {
    throughput: {
      element: "chart-throughput",
      series: [["done", "#2e8540"], ["failed", "#c62828"], ["cancelled", "#8a8f98"]],
      unit: function (v) { return v == null ? "-" : v.toFixed(1) + "/min"; },
      source: function (data) { return data.throughput; },
    },
    wait: {
      element: "chart-wait",
      series: [["p50", "#1f6feb"], ["p90", "#d4870b"], ["p99", "#b42318"]],
      unit: function (v) { return v == null ? "-" : v.toFixed(2) + " s"; },
      source: function (data) { return data.wait; },
    },
  };

  function columns(spec, data) {
    var values = spec.source(data);
    return [values.t].concat(spec.series.map(function (s) { return values[s[0]]; }));
  }

  function build(name, data) {
    var spec = specs[name];
    var element = document.getElementById(spec.element);
    var options = {
      width: Math.max(280, element.clientWidth),
      height: 220,
      tzDate: utc,
      cursor: { points: { size: 6 } },
      scales: { y: { range: function (u, min, max) { return [0, Math.max(1, max * 1.1)]; } } },
      legend: { live: false },
      axes: [{ values: function (u, ticks) { return ticks.map(function (t) { return stamp(t).slice(11, 16); }); } }, { size: 60, values: function (u, ticks) { return ticks.map(function (t) { return +t.toFixed(2); }); } }],
      series: [{ value: "{YYYY}-{MM}-{DD} {HH}:{mm} UTC" }].concat(spec.series.map(function (s) {
        return { label: s[0], stroke: s[1], width: 1.5, spanGaps: false, points: { show: false }, value: function (u, v) { return spec.unit(v); } };
      })),
    };
    state.charts[name] = new uPlot(options, columns(spec, data), element);
  }

  function update(data) {
    Object.keys(specs).forEach(function (name) {
      state.charts[name].setData(columns(specs[name], data));
    });
    var tables = document.getElementById("live-tables");
    if (tables && typeof data.tables === "string") tables.innerHTML = data.tables;
    document.getElementById("updated").textContent = "as of " + stamp(data.now) + " UTC";
  }

  function poll() {
    if (document.hidden) { schedule(); return; }
    fetch(api, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) throw new Error("HTTP " + response.status);
        return response.json();
      })
      .then(function (data) { update(data); state.refreshes += 1; })
      .catch(function (error) {
        state.failures += 1;
        document.getElementById("updated").textContent = "refresh failed (" + error.message + "); retrying";
      })
      .then(schedule);
  }

  var timer = null;
  function schedule() { clearTimeout(timer); timer = setTimeout(poll, refresh); }

  var initial = JSON.parse(source.textContent);
  Object.keys(specs).forEach(function (name) { build(name, initial); });
  window.addEventListener("resize", function () {
    Object.keys(specs).forEach(function (name) {
      var element = document.getElementById(specs[name].element);
      state.charts[name].setSize({ width: Math.max(280, element.clientWidth), height: 220 });
    });
  });
  document.addEventListener("visibilitychange", function () { if (!document.hidden) poll(); });
  schedule();
})();
