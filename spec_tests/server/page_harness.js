// Runs the demo page's app.js in a node vm with an inert DOM (every element a recording stub), then hands
// it data messages as the room would, and prints what the page took in as JSON. Used by test_static_page.py.
"use strict";
const fs = require("fs");
const vm = require("vm");

const assigned = []; // every value the page assigned to any element property
function stub(name) {
  return new Proxy(function () {}, {
    get(target, prop) {
      if (prop === Symbol.toPrimitive) return () => "";
      if (prop === Symbol.iterator) return function* () {};
      if (prop === "then") return undefined;
      return stub(`${name}.${String(prop)}`);
    },
    set(target, prop, value) {
      assigned.push(value);
      return true;
    },
    apply: () => stub(`${name}()`),
    construct: () => stub(`new ${name}`),
  });
}

const context = vm.createContext({
  document: stub("document"), window: stub("window"), localStorage: stub("localStorage"), navigator: stub("navigator"),
  location: { search: "", href: "http://127.0.0.1/", origin: "http://127.0.0.1", protocol: "http:", host: "127.0.0.1" },
  setInterval: () => 0, setTimeout: () => 0, clearInterval() {}, clearTimeout() {}, requestAnimationFrame: () => 0,
  performance: { now: () => 0 }, URLSearchParams, URL, console, crypto: require("crypto").webcrypto,
  TextDecoder, TextEncoder, fetch: () => new Promise(() => {}), WebSocket: stub("WebSocket"),
});
vm.runInContext(fs.readFileSync(process.argv[2], "utf8"), context, { filename: "app.js" });

const shown = (text) => assigned.some((value) => typeof value === "string" && value.includes(text));
const deliver = (topic, payload, from) =>
  vm.runInContext(`handleData(${JSON.stringify(topic)}, ${JSON.stringify(JSON.stringify(payload))}, ${JSON.stringify(from)})`, context);
const metrics = () => vm.runInContext("JSON.stringify(state.serverMetrics ?? null)", context);

const out = {};
for (const [who, from] of [["participant", "mallory"], ["nobody", null], ["worker", "chunkline-worker-0"]]) {
  deliver("tf.status", { type: "status", stage: `stage-from-${who}` }, from);
  deliver("tf.metrics", { type: "metrics", data: { published_frames: `frames-from-${who}` } }, from);
  out[who] = { status: shown(`stage-from-${who}`), metrics: metrics().includes(`frames-from-${who}`) };
}
console.log(JSON.stringify(out));
