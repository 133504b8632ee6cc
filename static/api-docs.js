// The API's docs page (/api/v1/docs): Swagger UI from the project's own static files (django-ninja's
// copy), fed the server's OpenAPI document. Nothing is fetched from anywhere else (no validator badge).
"use strict";
(function () {
  const settings = JSON.parse(document.getElementById("swagger-settings").textContent);
  window.forkyardDocs = SwaggerUIBundle(Object.assign(settings, {
    dom_id: "#swagger-ui",
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
    validatorUrl: null,
    deepLinking: true,
  }));
})();
