/* The sandbox page's terminal: xterm.js (static/vendor/xterm) on the console's terminal websocket.
 *
 * "Open a terminal" posts the page's form (sandboxes/views/sandboxes.py sandbox_terminal): the
 * sandbox starts a shell on a pty and the answer names its pid and socket path.  The socket
 * (Daphne, as the board's: FORKYARD_WEBSOCKET_URL, or this host on FORKYARD_WEBSOCKET_PORT) carries
 * the shell's output as binary frames and JSON for the rest ({type: exit|stderr|missed|error});
 * keys typed go back as binary frames, a new size as {type: "resize"}.  Leaving the page ends the
 * shell.  Tests read what it shows through window.forkyardTerminal.text().
 */
(function () {
  "use strict";
  const form = document.querySelector("form[data-terminal]");
  if (!form || typeof Terminal === "undefined") return;
  const holder = document.getElementById("terminal");
  const status = document.getElementById("terminal-status");
  let term = null, socket = null;

  function size() {
    const width = holder.parentElement.clientWidth || 640;
    return { cols: Math.max(20, Math.min(160, Math.floor((width - 24) / 9))), rows: 24 };
  }

  function say(text) { status.textContent = text; }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (socket && socket.readyState <= 1) { term.focus(); return; }
    const { cols, rows } = size();
    const body = new FormData(form);
    body.set("rows", rows); body.set("cols", cols);
    say("starting a shell…");
    let started;
    try {
      const answer = await fetch(form.action, { method: "POST", body: body, credentials: "same-origin", headers: { "X-Requested-With": "fetch" } });
      started = await answer.json();
      if (!answer.ok) { say(started.error ? started.error.message : "the terminal could not start"); return; }
    } catch (error) { say("the terminal could not start: " + error); return; }
    holder.hidden = false;
    if (!term) {
      term = new Terminal({ cols: cols, rows: rows, convertEol: false, cursorBlink: true, fontSize: 14, scrollback: 2000 });
      term.open(holder);
      term.onData((data) => { if (socket && socket.readyState === 1) socket.send(new TextEncoder().encode(data)); });
      term.onResize(({ cols, rows }) => { if (socket && socket.readyState === 1) socket.send(JSON.stringify({ type: "resize", rows: rows, cols: cols })); });
    } else {
      term.reset();
    }
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const base = form.dataset.socket || `${scheme}://${location.hostname}:${form.dataset.socketPort}`;
    socket = new WebSocket(base.replace(/\/$/, "") + started.socket);
    socket.binaryType = "arraybuffer";
    socket.onopen = () => { say(`shell ${started.pid}: connected`); term.focus(); };
    socket.onmessage = (message) => {
      if (message.data instanceof ArrayBuffer) { term.write(new Uint8Array(message.data)); return; }
      const event = JSON.parse(message.data);
      if (event.type === "stderr") term.write(Uint8Array.from(atob(event.data_b64), (c) => c.charCodeAt(0)));
      else if (event.type === "exit") say(`shell ${started.pid} exited (${event.exit_code === null ? "signal " + event.signal : "code " + event.exit_code})`);
      else if (event.type === "error") say(event.message);
    };
    socket.onclose = () => { if (!/exited/.test(status.textContent)) say("disconnected: open it again to start a new shell"); };
  });
  window.addEventListener("pagehide", () => { if (socket) socket.close(); });
  window.forkyardTerminal = {
    text: () => {
      if (!term) return "";
      const buffer = term.buffer.active, lines = [];
      for (let i = 0; i < buffer.length; i++) lines.push(buffer.getLine(i).translateToString(true));
      return lines.join("\n");
    },
    connected: () => Boolean(socket && socket.readyState === 1),
  };
})();
