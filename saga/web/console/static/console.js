// The run page, live: while a run is running or unwinding, the server sends its section
// again each time it moves (server-sent events). Without JavaScript the page still works
// (reload it).
(function () {
  "use strict";
  var target = document.querySelector("[data-live]");
  if (!target || !window.EventSource) return;
  var source = new EventSource(target.getAttribute("data-live"));
  source.addEventListener("update", function (event) {
    target.innerHTML = event.data;
    target.setAttribute("data-updated", String(Date.now()));
  });
  source.addEventListener("end", function () {
    source.close();
    var dot = target.querySelector(".live-dot");
    if (dot) dot.remove();
  });
})();
