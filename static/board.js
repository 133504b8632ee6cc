/* The live launch board: one canvas pixel per sandbox, fed by binary websocket frames.
 *
 * Frame format: see sandboxes/board.py.  On connect the server sends the
 * layout (the wordmark bitmap) and a snapshot; afterwards only deltas, at most
 * about ten a second, as runs of (start, length, state).  Deltas numbered at or
 * below the snapshot's sequence are older than it and skipped; a gap in the
 * numbering asks for a new snapshot.  Drawing is batched into one putImageData
 * per animation frame, so 32,752 pixels stay smooth.
 */
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("board-config").textContent);
  if (!config.launch) return;

  const COLORS = [0xff50413a, 0xff26a5e0, 0xff7fd035, 0xff4444ef, 0xff6b6059]; // ABGR: requested, starting, running, failed, stopped
  const BACKGROUND = 0xff120e0c;
  const canvas = document.getElementById("board-canvas");
  const context = canvas.getContext("2d");
  const status = document.getElementById("connection");
  let image = null, pixels = null, order = null, states = null;
  let snapshotSeq = -1, lastSeq = -1, dirty = false;
  let counters = null, history = [], chartReady = false, lastRate = { t: 0, done: 0, rate: 0 };

  function readHeader(view) {
    if (view.getUint8(0) !== 0x46 || view.getUint8(1) !== 0x59 || view.getUint8(2) !== 1) throw new Error("not a board frame");
    return { kind: String.fromCharCode(view.getUint8(3)), seq: view.getUint32(4, true), sections: view.getUint16(8, true), offset: 10 };
  }

  function readCounters(view, offset) {
    const names = ["requested", "queued", "creating", "running", "failed", "ended"];
    const values = {};
    names.forEach((name, i) => { values[name] = view.getUint32(offset + 4 * i, true); });
    values.elapsedMs = view.getUint32(offset + 24, true);
    values.costMicro = Number(view.getBigUint64(offset + 28, true));
    return values;
  }

  function layout(view, offset) {
    const width = view.getUint16(offset, true), height = view.getUint16(offset + 2, true);
    const rowBytes = (width + 7) >> 3, bits = offset + 4;
    canvas.width = width; canvas.height = height;
    image = context.createImageData(width, height);
    pixels = new Uint32Array(image.data.buffer);
    pixels.fill(BACKGROUND);
    const lit = [];
    for (let y = 0; y < height; y++) {
      for (let x = 0; x < width; x++) {
        if (view.getUint8(bits + y * rowBytes + (x >> 3)) & (0x80 >> (x & 7))) lit.push(y * width + x);
      }
    }
    order = Uint32Array.from(lit);
    states = new Uint8Array(order.length);
    for (let i = 0; i < order.length; i++) pixels[order[i]] = COLORS[0];
    dirty = true;
    return bits + rowBytes * height;
  }

  function paint(index, state) {
    if (index < states.length && states[index] !== state) {
      states[index] = state;
      pixels[order[index]] = COLORS[state] || COLORS[0];
    }
  }

  function handle(buffer) {
    const view = new DataView(buffer);
    const header = readHeader(view);
    let offset = header.offset;
    for (let s = 0; s < header.sections; s++) {
      const length = view.getUint8(offset);
      const launch = new TextDecoder().decode(new Uint8Array(buffer, offset + 1, length));
      offset += 1 + length;
      const mine = launch === config.launch;
      if (header.kind === "L") {
        if (mine) offset = layout(view, offset);
        else offset += 4 + ((view.getUint16(offset, true) + 7) >> 3) * view.getUint16(offset + 2, true);
        continue;
      }
      const sectionCounters = readCounters(view, offset);
      offset += 36;
      const items = view.getUint32(offset, true);
      offset += 4;
      if (header.kind === "S") {
        if (mine && states) {
          for (let i = 0; i < items; i++) paint(i, view.getUint8(offset + i));
          snapshotSeq = lastSeq = header.seq;
          showCounters(sectionCounters);
        }
        offset += items;
      } else {
        if (mine && states && header.seq > snapshotSeq) {
          for (let r = 0; r < items; r++) {
            const base = offset + 7 * r;
            const start = view.getUint32(base, true), count = view.getUint16(base + 4, true), state = view.getUint8(base + 6);
            for (let i = start; i < start + count; i++) paint(i, state);
          }
          showCounters(sectionCounters);
        }
        offset += 7 * items;
      }
      dirty = true;
    }
    if (header.kind === "D") {
      if (lastSeq >= 0 && header.seq > lastSeq + 1 && header.seq > snapshotSeq + 1) resync();
      lastSeq = Math.max(lastSeq, header.seq);
    }
  }

  function showCounters(values) {
    counters = values;
    const set = (id, text) => { const node = document.getElementById(id); if (node) node.textContent = text; };
    set("c-requested", values.requested.toLocaleString());
    set("c-running", values.running.toLocaleString());
    set("c-failed", values.failed.toLocaleString());
    set("c-elapsed", (values.elapsedMs / 1000).toFixed(1) + " s");
    set("c-cost", "$" + (values.costMicro / 1e6).toFixed(4));
    // The state printed with the page goes stale; "ready" follows the API's own rule
    // (sandboxes/selectors.py launch_out): nothing queued or creating any more.
    const state = document.getElementById("launch-state");
    if (state && state.textContent === "creating" && values.queued === 0 && values.creating === 0) state.textContent = "ready";
    const done = values.running + values.failed + values.ended;
    const now = values.elapsedMs / 1000;
    if (now - lastRate.t >= 0.5) {
      lastRate = { t: now, done: done, rate: lastRate.t ? (done - lastRate.done) / (now - lastRate.t) : done / Math.max(now, 0.001) };
      set("c-rate", Math.max(0, Math.round(lastRate.rate)).toLocaleString());
    }
    chart(now, values.running);
  }

  function chart(seconds, running) {
    if (typeof Plotly === "undefined") return;
    if (!chartReady) {
      Plotly.newPlot("running-chart", [{ x: [seconds], y: [running], mode: "lines", line: { color: "#1f8a4c", width: 2 }, name: "running" }],
        { margin: { t: 10, r: 10, b: 35, l: 50 }, xaxis: { title: "seconds" }, yaxis: { title: "running", rangemode: "tozero" } },
        { displayModeBar: false, responsive: true });
      chartReady = true;
    } else if (history.length === 0 || seconds > history[history.length - 1]) {
      Plotly.extendTraces("running-chart", { x: [[seconds]], y: [[running]] }, [0], 2000);
    }
    history.push(seconds);
  }

  function draw() {
    if (dirty && image) { context.putImageData(image, 0, 0); dirty = false; }
    requestAnimationFrame(draw);
  }
  requestAnimationFrame(draw);

  let socket = null, backoff = 500;
  function resync() { if (socket && socket.readyState === 1) socket.send(JSON.stringify({ type: "resync" })); }
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}/ws/board/${config.launch}/`);
    socket.binaryType = "arraybuffer";
    socket.onopen = () => { status.textContent = "live"; backoff = 500; };
    socket.onmessage = (event) => { if (event.data instanceof ArrayBuffer) handle(event.data); };
    socket.onclose = () => {
      status.textContent = "reconnecting…";
      snapshotSeq = lastSeq = -1;
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 10000);
    };
  }
  connect();
  // A read-only view for tests (tests/browser) and the curious: copies of the pixel
  // states (sandboxes/board_protocol.py's numbering, in launch order) and the last counters.
  window.forkyardBoard = {
    states: () => (states ? states.slice() : null),
    counters: () => (counters ? Object.assign({}, counters) : null),
  };
})();
