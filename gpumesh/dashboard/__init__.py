"""The web dashboard (``gpumesh dashboard``, the ``dashboard`` extra): what ``gpumesh top``, ``status`` and
``logs`` show, in a browser, live, for people who would rather not watch a terminal. Server-rendered pages
over the Python API, refreshed over server-sent events; cancel and retry only for a credential that may.

Nothing here is imported by ``gpumesh`` itself: starlette, uvicorn and jinja2 are needed only to run it.
"""
