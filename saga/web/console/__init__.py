"""The operator console: server-rendered pages under ``/console`` (``pages``: reading,
``forms``: acting, ``live``: the run page's server-sent updates), behind a login."""
