/* The live launch board: one block of canvas pixels per sandbox, fed by binary websocket frames.
 *
 * Frame format: see sandboxes/board/ticker.py (and protocol.py).  The page carries the launch's
 * first frame (its layout and a snapshot, the same bytes as the socket's first two messages), so
 * the board is drawn from the server's state before any message arrives; the socket then sends
 * deltas, at most about ten a second, as runs of (start, length, state).  Deltas numbered at or
 * below the snapshot's sequence are older than it and skipped; a gap in the numbering asks for a
 * new snapshot.  Drawing is batched into one putImageData per animation frame.
 *
 * Each sandbox is a square of whole device pixels (the largest scale that fits), with a one-pixel
 * gap once there is room for one, so that even at 32,752 the wordmark reads as separate
 * sandboxes.  A pixel is off only once its sandbox has really ended; "stopping" has its own
 * colour, and the cost clock is the server's (it stops when the last period closes).
 */
(function () {
  "use strict";
  const config = JSON.parse(document.getElementById("board-config").textContent);
  if (!config.launch) return;

  // ABGR, indexed by pixel state (protocol.py): requested, starting, running, failed, off, stopping, paused.
  const COLORS = [0xff50413a, 0xff26a5e0, 0xff7fd035, 0xff4444ef, 0xff29201c, 0xff2a61f0, 0xfff59c5b];
  const STATE = { requested: 0, starting: 1, running: 2, failed: 3, off: 4, stopping: 5, paused: 6 };
  const BACKGROUND = 0xff120e0c;
  const canvas = document.getElementById("board-canvas");
  const stage = document.getElementById("board-stage");
  const context = canvas.getContext("2d");
  const status = document.getElementById("connection");
  let image = null, pixels = null, order = null, states = null, layoutWidth = 0, layoutHeight = 0, scale = 1, block = 1;
  let snapshotSeq = -1, lastSeq = -1, dirty = false, messages = 0, firstFrameDrawn = false;
  let counters = null, history = [], chartReady = false, lastRate = { t: 0, done: 0 };
  let peak = config.pace ? config.pace.peak : 0, headlineShown = Boolean(config.pace && config.pace.all_running_s !== null);
  let ended = false;

  function readHeader(view) {
    if (view.getUint8(0) !== 0x46 || view.getUint8(1) !== 0x59 || view.getUint8(2) !== 2) throw new Error("not a board frame (version 2)");
    return { kind: String.fromCharCode(view.getUint8(3)), seq: view.getUint32(4, true), sections: view.getUint16(8, true), offset: 10 };
  }

  const COUNTERS_SIZE = 44; // 8 x u32, elapsed u32, cost u64
  function readCounters(view, offset) {
    const names = ["requested", "queued", "creating", "running", "failed", "ended", "paused", "stopping"];
    const values = {};
    names.forEach((name, i) => { values[name] = view.getUint32(offset + 4 * i, true); });
    values.elapsedMs = view.getUint32(offset + 32, true);
    values.costMicro = Number(view.getBigUint64(offset + 36, true));
    return values;
  }

  // --- geometry: whole device pixels per sandbox -------------------------------------------------
  function fitScale() {
    const ratio = window.devicePixelRatio || 1;
    const room = stage.getBoundingClientRect();
    const style = getComputedStyle(stage);
    const width = (room.width - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)) * ratio;
    let height = config.present ? (room.height - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom)) * ratio : window.innerHeight * 0.6 * ratio;
    if (document.fullscreenElement) height = (window.innerHeight - 120) * ratio;
    return Math.max(1, Math.floor(Math.min(width / layoutWidth, height / layoutHeight)));
  }

  function resize() {
    if (!layoutWidth) return;
    const fitted = fitScale();
    if (image && fitted === scale) return;
    scale = fitted;
    block = scale >= 2 ? scale - 1 : 1; // a one-pixel gap between sandboxes once the scale leaves room
    const ratio = window.devicePixelRatio || 1;
    canvas.width = layoutWidth * scale;
    canvas.height = layoutHeight * scale;
    canvas.style.width = `${canvas.width / ratio}px`;
    canvas.style.height = `${canvas.height / ratio}px`;
    image = context.createImageData(canvas.width, canvas.height);
    pixels = new Uint32Array(image.data.buffer);
    pixels.fill(BACKGROUND);
    if (states) for (let i = 0; i < states.length; i++) fill(i, states[i]);
    dirty = true;
  }

  function fill(index, state) {
    const at = order[index], x = (at % layoutWidth) * scale, y = Math.floor(at / layoutWidth) * scale;
    const color = COLORS[state] === undefined ? COLORS[0] : COLORS[state];
    for (let dy = 0; dy < block; dy++) {
      const row = (y + dy) * canvas.width + x;
      for (let dx = 0; dx < block; dx++) pixels[row + dx] = color;
    }
  }

  function layout(view, offset) {
    layoutWidth = view.getUint16(offset, true);
    layoutHeight = view.getUint16(offset + 2, true);
    const rowBytes = (layoutWidth + 7) >> 3, bits = offset + 4;
    const lit = [];
    for (let y = 0; y < layoutHeight; y++) {
      for (let x = 0; x < layoutWidth; x++) {
        if (view.getUint8(bits + y * rowBytes + (x >> 3)) & (0x80 >> (x & 7))) lit.push(y * layoutWidth + x);
      }
    }
    order = Uint32Array.from(lit);
    states = new Uint8Array(order.length);
    image = null;
    resize();
    return bits + rowBytes * layoutHeight;
  }

  function paint(index, state) {
    if (index < states.length && states[index] !== state) {
      states[index] = state;
      fill(index, state);
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
      offset += COUNTERS_SIZE;
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

  function set(id, text) { const node = document.getElementById(id); if (node && node.textContent !== text) node.textContent = text; }

  function money(micro) {
    const dollars = micro / 1e6;
    if (micro === 0) return "$0.00";
    if (dollars >= 0.01) return "$" + dollars.toLocaleString(undefined, { minimumFractionDigits: 2, maximumFractionDigits: 2 });
    return "$" + dollars.toFixed(6).replace(/0+$/, "");
  }

  function showCounters(values) {
    counters = values;
    set("c-requested", values.requested.toLocaleString());
    set("c-running", (values.running - values.paused).toLocaleString());
    set("c-paused", values.paused.toLocaleString());
    set("c-stopping", values.stopping.toLocaleString());
    set("c-failed", values.failed.toLocaleString());
    set("c-elapsed", (values.elapsedMs / 1000).toFixed(1) + " s");
    set("c-cost", money(values.costMicro));
    const starting = values.queued + values.creating > 0;
    const state = document.getElementById("launch-state");
    // The state printed with the page goes stale; "ready" follows the API's own rule
    // (sandboxes/selectors.py launch_progress): nothing queued or creating any more.
    if (state && state.textContent === "creating" && !starting) state.textContent = "ready";
    if (state && values.running === 0 && values.stopping === 0 && values.queued + values.creating === 0 && values.ended + values.failed === values.requested && state.textContent === "stopping") {
      state.textContent = "stopped";
    }
    // Sandboxes started per second: what came up in the last half second or more, while the launch starts.
    const done = values.running + values.failed + values.ended;
    const now = values.elapsedMs / 1000;
    if (starting && now - lastRate.t >= 0.5) {
      const rate = lastRate.t ? (done - lastRate.done) / (now - lastRate.t) : done / Math.max(now, 0.001);
      lastRate = { t: now, done: done };
      peak = Math.max(peak, Math.round(rate));
      set("c-rate", Math.max(0, Math.round(rate)).toLocaleString());
      set("c-rate-average", (done / Math.max(now, 0.001)).toFixed(1));
      set("c-rate-peak", peak.toLocaleString());
    } else if (!starting) {
      set("c-rate", "0");
    }
    if (!starting && !headlineShown && values.running > 0 && values.ended === 0) {
      headlineShown = true;
      set("headline", `${values.running.toLocaleString()} running in ${Math.round(now)} s`);
    }
    const over = values.running === 0 && values.stopping === 0 && !starting && values.ended + values.failed === values.requested;
    if (over && !ended) { ended = true; if (status) status.textContent = "ended"; }
    chart(now, values.running);
  }

  function chart(seconds, running) {
    if (typeof Plotly === "undefined" || !document.getElementById("running-chart")) return;
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

  function fromBase64(text) {
    const raw = atob(text), bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    return bytes.buffer;
  }

  // The first frame, from the page itself: drawn now, before any websocket message.
  if (config.first_frame) {
    handle(fromBase64(config.first_frame.layout));
    handle(fromBase64(config.first_frame.snapshot));
    if (image) { context.putImageData(image, 0, 0); dirty = false; }
    firstFrameDrawn = true;
  }
  requestAnimationFrame(draw);
  window.addEventListener("resize", resize);
  document.addEventListener("fullscreenchange", () => { image = null; resize(); });
  // Once the page has laid out (the counters column beside it), fit again.
  window.addEventListener("load", () => { image = null; resize(); });

  let socket = null, backoff = 500;
  function resync() { if (socket && socket.readyState === 1) socket.send(JSON.stringify({ type: "resync" })); }
  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    // The board's websockets are served apart from the pages (Daphne beside the HTTP server), on
    // FORKYARD_WEBSOCKET_URL or, by default, this page's host on FORKYARD_WEBSOCKET_PORT.
    const base = config.socket || `${scheme}://${location.hostname}:${config.socket_port}`;
    socket = new WebSocket(`${base.replace(/\/$/, "")}/ws/board/${config.launch}/`);
    socket.binaryType = "arraybuffer";
    socket.onopen = () => { if (!ended) status.textContent = "live"; backoff = 500; };
    socket.onmessage = (event) => { if (event.data instanceof ArrayBuffer) { messages += 1; handle(event.data); } };
    socket.onclose = () => {
      if (!ended) status.textContent = "reconnecting…";
      snapshotSeq = lastSeq = -1;
      setTimeout(connect, backoff);
      backoff = Math.min(backoff * 2, 10000);
    };
  }
  connect();

  // Tear down in place: asked first (naming whose launch), posted without leaving the page.
  const teardown = document.getElementById("teardown-form");
  if (teardown) {
    teardown.addEventListener("submit", async (event) => {
      event.preventDefault();
      event.stopPropagation();
      if (!window.confirm(teardown.dataset.confirm)) return;
      const button = document.getElementById("teardown");
      button.disabled = true;
      try {
        const answer = await fetch(teardown.action, { method: "POST", body: new FormData(teardown), credentials: "same-origin", headers: { "X-Requested-With": "fetch" } });
        if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
        const body = await answer.json();
        set("launch-state", body.state);
        button.textContent = "Tearing down…";
      } catch (error) {
        button.disabled = false;
        status.textContent = "tear down failed: " + error.message;
      }
    }, true);
  }

  // Presenting: full screen on request (the button, or F).
  const full = document.getElementById("fullscreen");
  const board = document.getElementById("board");
  function fullscreen() { if (board.requestFullscreen) board.requestFullscreen().catch(() => {}); }
  if (full) full.addEventListener("click", fullscreen);
  if (config.present) document.addEventListener("keydown", (event) => { if (event.key === "f" || event.key === "F") fullscreen(); });

  // A read-only view for tests (tests/browser) and the curious: copies of the pixel states (protocol.py's
  // numbering, in launch order), the last counters, how many websocket messages came, and the geometry.
  window.forkyardBoard = {
    states: () => (states ? states.slice() : null),
    counters: () => (counters ? Object.assign({}, counters) : null),
    messages: () => messages,
    firstFrameDrawn: () => firstFrameDrawn,
    geometry: () => ({ width: layoutWidth, height: layoutHeight, scale: scale, block: block, canvasWidth: canvas.width, canvasHeight: canvas.height }),
    position: (index) => (order ? { x: (order[index] % layoutWidth) * scale, y: Math.floor(order[index] / layoutWidth) * scale } : null),
    colors: () => COLORS.slice(),
    STATE: STATE,
  };
})();
