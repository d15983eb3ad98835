"""The chat page at / of `llmsplit serve`, as llama.cpp's server has one: chat.html, one static
file of HTML, CSS and JavaScript shipped in the package, so it works offline with no build step.

The page holds no data, so it is served without the API key (edge.Gate guards /v1, /api/
and, on request, /metrics); it asks for the key itself when /v1/models answers 401 and sends
it on the same /v1/chat/completions route every client uses. Its Content-Security-Policy lets
only the page's own script and style run (named by their hashes) and lets it talk only to
this server.
"""

from __future__ import annotations

import base64
import hashlib
import re
from importlib.resources import files

from fastapi.responses import HTMLResponse


def add_chat_page(app) -> None:
    page = files(__package__).joinpath("chat.html").read_text(encoding="utf-8")
    headers = {"Content-Security-Policy": content_security_policy(page), "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

    async def chat_page():
        return HTMLResponse(page, headers=headers)

    app.get("/", include_in_schema=False)(chat_page)


def content_security_policy(page: str) -> str:
    """Nothing from another origin, no inline code but the page's own <script> and <style> (by
    their hashes: text that reached the page as markup still could not run), fetches only to
    this server."""
    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S)
        assert blocks, f"chat.html has no <{tag}>"
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            f"img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
