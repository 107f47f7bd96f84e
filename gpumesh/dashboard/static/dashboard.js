// gpumesh dashboard: keeps the live regions of a page current over server-sent events.
// An element with data-live="/live/..." gets its innerHTML replaced by each event's HTML; one that also
// has data-append="1" (a task's log) gets the lines appended instead, until an "end" event, after which
// it carries data-ended="1". No inline script anywhere: the page's Content-Security-Policy forbids it.
(function () {
  "use strict";

  function follow(el) {
    var url = el.getAttribute("data-live");
    if (!url || !window.EventSource) {
      return;
    }
    var append = el.getAttribute("data-append") === "1";
    var source = new EventSource(url);

    source.onmessage = function (event) {
      el.innerHTML = event.data;  // HTML the server rendered and escaped
    };
    source.addEventListener("lines", function (event) {
      var atBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 4;
      el.insertAdjacentHTML("beforeend", event.data);
      if (atBottom) {
        window.scrollTo(0, document.body.scrollHeight);
      }
    });
    source.addEventListener("trouble", function (event) {
      var state = document.getElementById("log-state");
      if (state) {
        state.textContent = event.data.replace(/<[^>]*>/g, "");
      }
    });
    source.addEventListener("end", function () {
      source.close();
      el.setAttribute("data-ended", "1");
      el.removeAttribute("data-live");
      var state = document.getElementById("log-state");
      if (state) {
        state.textContent = "ended";
      }
    });
    source.addEventListener("gone", function (event) {
      source.close();
      el.innerHTML = event.data;
    });
    if (append) {
      source.onmessage = null;
    }
  }

  function start() {
    var regions = document.querySelectorAll("[data-live]");
    for (var i = 0; i < regions.length; i++) {
      follow(regions[i]);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
