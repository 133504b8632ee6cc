// forkyard console: draws the plotly figures a page carries, and wires what pages declare. Each figure is built on
// the server (billing/charts.py) and sits in a <script type="application/json">
// named by the data-figure attribute of the element it is drawn into.
"use strict";

function drawFigures(root) {
  if (typeof Plotly === "undefined") return;
  for (const node of root.querySelectorAll("[data-figure]")) {
    const source = document.getElementById(node.dataset.figure);
    if (!source) continue;
    const figure = JSON.parse(source.textContent);
    // No mode bar: it would sit on the legend, and hovering already reads the values.
    Plotly.react(node, figure.data, figure.layout, { displayModeBar: false, responsive: true });
  }
}

document.addEventListener("DOMContentLoaded", () => drawFigures(document));
// Partials that htmx swaps in may carry figures too.
document.addEventListener("htmx:afterSettle", (event) => drawFigures(event.target));

// Behaviour the pages declare in data attributes (the Content-Security-Policy allows no inline
// handlers): data-confirm asks before a form is sent, data-submit-on-change sends its form when a
// choice changes, data-select-on-focus selects a field's text (a link to copy).
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (form && !window.confirm(form.dataset.confirm)) event.preventDefault();
});
document.addEventListener("change", (event) => {
  if (event.target.matches("[data-submit-on-change]")) event.target.form.requestSubmit();
});
document.addEventListener("focusin", (event) => {
  if (event.target.matches("[data-select-on-focus]")) event.target.select();
});

// data-copy="<id>": the button copies that element's text (a new key's secret) and says so.
document.addEventListener("click", async (event) => {
  const button = event.target.closest("[data-copy]");
  if (button) {
    const source = document.getElementById(button.dataset.copy);
    const said = document.getElementById(button.getAttribute("aria-describedby") || "");
    const text = source ? source.textContent.trim() : "";
    try {
      await navigator.clipboard.writeText(text);
      if (said) said.textContent = "Copied to the clipboard.";
    } catch (error) {
      // No clipboard (an insecure origin, a refusal): select it for Ctrl+C instead.
      const range = document.createRange();
      range.selectNodeContents(source);
      const selection = window.getSelection();
      selection.removeAllRanges();
      selection.addRange(range);
      if (said) said.textContent = "Selected: press Ctrl+C (or ⌘C) to copy.";
    }
    return;
  }
  if (event.target.closest("[data-print]")) window.print();
});
