// Progressive enhancement only: every page and action works without this file.
// - forms with data-confirm ask in a dialog and, when confirmed, skip the server's
//   confirmation page (confirm=yes);
// - the overview's "refresh every 5 s" box reloads the queue table in place.
"use strict";
document.addEventListener("submit", function (event) {
  var form = event.target;
  var question = form.getAttribute && form.getAttribute("data-confirm");
  if (!question) { return; }
  if (!window.confirm(question)) { event.preventDefault(); return; }
  var flag = document.createElement("input");
  flag.type = "hidden"; flag.name = "confirm"; flag.value = "yes";
  form.appendChild(flag);
});
document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("autorefresh");
  if (!box) { return; }
  box.checked = window.sessionStorage.getItem("pgjobs-refresh") === "1";
  var timer = null;
  function tick() {
    fetch(window.location.href, {credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (text) {
        if (!text) { return; }
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("queues");
        var old = document.getElementById("queues");
        if (fresh && old) { old.replaceWith(fresh); }
      })
      .catch(function () {});
  }
  function arm() {
    window.sessionStorage.setItem("pgjobs-refresh", box.checked ? "1" : "0");
    if (timer) { window.clearInterval(timer); timer = null; }
    if (box.checked) { timer = window.setInterval(tick, 5000); }
  }
  box.addEventListener("change", arm);
  arm();
});
