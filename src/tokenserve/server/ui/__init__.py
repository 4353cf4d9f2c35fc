"""The browser UI of `tokenserve serve`: a playground and a live dashboard at `/` on the OpenAI
port (`--noui` turns it off).

The page itself (`static/`: HTML, CSS and plain ES modules, no build step, no CDN) needs no API
key, so a browser can load it and then ask for one; everything it shows comes from routes that
do: the OpenAI API and `/ui/api/stats` (stats.py), both behind the OpenAI app's key check.
"""

from __future__ import annotations

from .files import StaticUI, with_ui

__all__ = ["StaticUI", "with_ui"]
