// The run page, live: while a run is running or unwinding, the server sends its section
// again each time it moves (server-sent events). Without JavaScript the page still works
// (reload it).
(function () {
  "use strict";
  // The error page's Back link: the previous page when there is one (a script, as the
  // Content-Security-Policy refuses javascript: links), else the runs.
  var back = document.querySelector("[data-back]");
  if (back && window.history.length > 1) {
    back.addEventListener("click", function (event) {
      event.preventDefault();
      window.history.back();
    });
  }
  var target = document.querySelector("[data-live]");
  if (!target || !window.EventSource) return;
  var source = new EventSource(target.getAttribute("data-live"));
  source.addEventListener("update", function (event) {
    target.innerHTML = event.data;
    target.setAttribute("data-updated", String(Date.now()));
  });
  function ended() {
    source.close();
    target.setAttribute("data-ended", String(Date.now()));
    var dot = target.querySelector(".live-dot");
    if (dot) dot.remove();
  }
  source.addEventListener("end", ended);
  // Refused (logged out, too many streams open): the browser gives up; say so.
  source.addEventListener("error", function () {
    if (source.readyState === EventSource.CLOSED) ended();
  });
})();
