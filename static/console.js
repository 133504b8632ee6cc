// forkyard console: draws the plotly figures a page carries. Each figure is built on
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
