/* The sandbox page's live view of its desktop: noVNC's client (static/vendor/novnc, served by the
 * console, loaded on first use) on the console's websocket /ws/desktop/<sandbox>/<mode>/
 * (sandboxes/views/live_view.py), which carries the bytes of the desktop's VNC server in the
 * sandbox and nothing else: no page or script from inside the sandbox runs here.  `view` is a VNC
 * server that drops input itself; `control` takes the mouse and keyboard over the screen.  The
 * panel arrives after the page (htmx), so clicks are listened for on the document. */
(() => {
  "use strict";
  let session = null;

  function say(text) {
    const status = document.getElementById("desktop-status");
    if (status) status.textContent = text;
  }

  function close() {
    const current = session;
    session = null;
    if (current) current.disconnect();
    const panel = document.getElementById("desktop-live");
    if (panel) panel.querySelector("[data-desktop-close]").hidden = true;
  }

  async function open(panel, mode) {
    close();
    say("connecting…");
    const { default: RFB } = await import(panel.dataset.client);
    const screen = panel.querySelector("#desktop-screen");
    screen.replaceChildren();
    screen.hidden = false;
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const base = panel.dataset.socket || `${scheme}://${location.hostname}:${panel.dataset.socketPort}`;
    const url = `${base.replace(/\/$/, "")}/ws/desktop/${encodeURIComponent(panel.dataset.sandbox)}/${mode}/`;
    const current = new RFB(screen, url);
    current.viewOnly = mode === "view";
    current.scaleViewport = true;
    current.background = "#0f1115";
    current.addEventListener("connect", () => {
      screen.dataset.mode = mode;
      say(mode === "view" ? "Watching: nothing you do here reaches the desktop." : "In control: the mouse and keyboard over the screen are the desktop's.");
      if (mode === "control") current.focus();
    });
    current.addEventListener("disconnect", (event) => {
      delete screen.dataset.mode;
      if (session !== current) return;  // closed from here, or replaced by another view
      session = null;
      panel.querySelector("[data-desktop-close]").hidden = true;
      say(event.detail.clean ? "The view closed." : "Disconnected: the desktop stopped, or the sandbox is no longer running.");
    });
    session = current;
    panel.querySelector("[data-desktop-close]").hidden = false;
  }

  document.addEventListener("click", (event) => {
    const target = event.target instanceof Element ? event.target : null;
    const panel = target && target.closest("#desktop-live");
    if (!panel) return;
    const button = target.closest("[data-desktop-mode]");
    if (button) {
      open(panel, button.dataset.desktopMode).catch((error) => say(`The view could not start: ${error}`));
    } else if (target.closest("[data-desktop-close]")) {
      close();
      panel.querySelector("#desktop-screen").hidden = true;
      say("The view closed.");
    }
  });
  window.addEventListener("pagehide", close);
})();
