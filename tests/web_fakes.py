"""Local servers that answer like Serper, Jina Reader and ordinary web sites do, with
their real response shapes and failure modes, for the web backend's tests."""

from __future__ import annotations

import asyncio
import gzip
from collections import deque
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

SERPER_KEY = "serper-test-key-4f9a"
JINA_KEY = "jina_test_key_77c1"


def serper_response(q: str) -> dict[str, Any]:
    """The shape of a real google.serper.dev /search answer."""
    return {
        "searchParameters": {
            "q": q,
            "gl": "us",
            "hl": "en",
            "type": "search",
            "num": 10,
            "page": 1,
            "engine": "google",
        },
        "knowledgeGraph": {
            "title": "Danube",
            "type": "River",
            "description": "The Danube is Europe's second-longest river.",
            "descriptionSource": "Wikipedia",
            "descriptionLink": "https://en.wikipedia.org/wiki/Danube",
            "attributes": {"Length": "2,850 km"},
        },
        "answerBox": {"title": "Danube length", "answer": "2,850 km"},
        "organic": [
            {
                "title": "Danube - Wikipedia",
                "link": "https://en.wikipedia.org/wiki/Danube",
                "snippet": "The Danube is the second-longest river in Europe...",
                "sitelinks": [{"title": "Course", "link": "https://en.wikipedia.org/wiki/Danube#Course"}],
                "position": 1,
            },
            {
                "title": "BrowseComp dataset",
                "link": "https://huggingface.co/datasets/openai/browsecomp",
                "snippet": "answers...",
                "position": 2,
            },
            {
                "title": "Danube | river, Europe",
                "link": "https://www.britannica.com/place/Danube-River",
                "snippet": "Danube River, river, the second longest in Europe after the Volga.",
                "date": "Oct 1, 2025",
                "position": 3,
            },
        ],
        "peopleAlsoAsk": [
            {
                "question": "Where does the Danube start?",
                "snippet": "Black Forest",
                "title": "t",
                "link": "https://x.org",
            }
        ],
        "relatedSearches": [{"query": "danube river map"}],
        "credits": 1,
    }


def make_serper(script: list[Any] | None = None) -> FastAPI:
    """``script`` items in order, then normal answers: an int status, ("retry-after", s), "malformed", "slow"."""
    app = FastAPI()
    app.state.requests = []
    queue = deque(script or [])

    @app.post("/search")
    async def search(request: Request):
        body = await request.json()
        app.state.requests.append({"body": body, "headers": dict(request.headers)})
        if request.headers.get("x-api-key") != SERPER_KEY:
            return JSONResponse({"message": "Unauthorized.", "statusCode": 403}, status_code=403)
        item = queue.popleft() if queue else None
        if isinstance(item, tuple):
            return JSONResponse(
                {"message": "Too many requests"}, status_code=429, headers={"Retry-After": str(item[1])}
            )
        if isinstance(item, int):
            return JSONResponse({"message": "Internal error"}, status_code=item)
        if item == "malformed":
            return PlainTextResponse("<html>upstream proxy error</html>")
        if item == "slow":
            await asyncio.sleep(3)
        # more than 10 results is billed 2 credits (Serper's pricing as others report it)
        return JSONResponse({**serper_response(body["q"]), "credits": 1 if body.get("num", 10) <= 10 else 2})

    return app


def make_jina(script: list[Any] | None = None) -> FastAPI:
    """Jina Reader: ``POST /`` with the form field ``url``, or ``GET /{url}`` (which the Reader
    decodes once); JSON with Accept: application/json, else the Title:/URL Source: text form."""
    app = FastAPI()
    app.state.requests = []
    queue = deque(script or [])

    @app.post("/")
    async def read_form(request: Request):
        form = parse_qs((await request.body()).decode(), keep_blank_values=True)
        return await answer(form.get("url", [""])[0], request)

    @app.get("/{target:path}")
    async def read(target: str, request: Request):
        return await answer(target, request)

    async def answer(target: str, request: Request):
        app.state.requests.append(
            {"target": target, "method": request.method, "headers": dict(request.headers)}
        )
        item = queue.popleft() if queue else None
        if item == 402:
            return JSONResponse(
                {
                    "data": None,
                    "code": 402,
                    "name": "InsufficientBalanceError",
                    "status": 40203,
                    "message": "Account balance not enough to run this query, please recharge.",
                    "readableMessage": "InsufficientBalanceError: Account balance not enough",
                },
                status_code=402,
            )
        if item == 422:
            return JSONResponse(
                {
                    "data": None,
                    "code": 422,
                    "name": "AssertionFailureError",
                    "status": 42206,
                    "message": "Failed to goto https://x/file.pdf: Unprocessable",
                },
                status_code=422,
            )
        if isinstance(item, int):
            return JSONResponse({"code": item, "message": "error"}, status_code=item)
        content = f"# Page about {target}\n\nThe Danube flows through Vienna. It is 2,850 km long."
        if item == "huge":  # a page of 3 MB
            content += " The Danube." * 250_000
        warning = None
        if item == "target-404":  # the Reader answers 200 with the site's error page and a warning
            content, warning = "# 404 Not Found", "Target URL returned error 404: Not Found"
        if "application/json" in request.headers.get("accept", ""):
            # "landed:<url>": the target redirected there (the Reader reports where it landed)
            landed = (
                item[len("landed:") :] if isinstance(item, str) and item.startswith("landed:") else target
            )
            data = {"title": "Danube", "description": "river", "url": landed, "content": content}
            if warning:
                data["warning"] = warning
            return JSONResponse({"code": 200, "status": 20000, "data": {**data, "usage": {"tokens": 42}}})
        warned = f"Warning: {warning}\n\n" if warning else ""  # where the Reader's text form puts it
        return PlainTextResponse(
            f"Title: Danube\n\nURL Source: {target}\n\n{warned}Markdown Content:\n{content}"
        )

    return app


def make_site(other_base: str | None = None) -> FastAPI:
    """An ordinary web site: pages, redirects, a gzip bomb, a slow page, a binary file."""
    app = FastAPI()

    @app.get("/page")
    async def page():
        return HTMLResponse(
            "<html><head><title>Vienna</title><script>var x=1;</script></head><body><nav>menu</nav>"
            "<h1>Vienna</h1><p>The Danube flows through Vienna.</p><p>Population: 2 million.</p></body></html>"
        )

    @app.get("/redirect-here")
    async def redirect_here():
        return RedirectResponse("/page", status_code=302)

    @app.get("/redirect-away")
    async def redirect_away():
        return RedirectResponse(f"{other_base}/page", status_code=302)

    @app.get("/redirect-loop")
    async def redirect_loop():
        return RedirectResponse("/redirect-loop", status_code=302)

    @app.get("/bomb")
    async def bomb():
        payload = gzip.compress(b"A" * 50_000_000, compresslevel=9)  # 50 MB of 'A' in ~50 KB
        return Response(payload, media_type="text/plain", headers={"Content-Encoding": "gzip"})

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(5)
        return HTMLResponse("<p>late</p>")

    @app.get("/file.pdf")
    async def pdf():
        return Response(b"%PDF-1.4...", media_type="application/pdf")

    @app.get("/brotli")
    async def brotli():
        return Response(b"\x1b\x00", media_type="text/html", headers={"Content-Encoding": "br"})

    # What the fault-injection battery found (issue #25): pages that stalled or crashed the reader.
    @app.get("/quadratic")
    async def quadratic(n: int = 80_000):
        return HTMLResponse("<title>Q</title><p>before</p>" + "<a" * n)

    @app.get("/charset/{name}")
    async def charset(name: str):
        return Response(
            b"<p>The Danube flows through Vienna.</p>", headers={"Content-Type": f"text/html; charset={name}"}
        )

    @app.get("/marked-section")
    async def marked_section():
        return HTMLResponse("<p>The Danube flows through Vienna.</p><![ x")

    @app.get("/corrupt-gzip")
    async def corrupt_gzip():
        body = gzip.compress(b"<p>The Danube flows through Vienna.</p>" * 100)
        return Response(
            body[:20] + b"\xff" * 40 + body[60:], media_type="text/html", headers={"Content-Encoding": "gzip"}
        )

    # The hostile-input audit: gzip streams whose inflated size never reaches the cap.
    def streamed(head: bytes, tail: bytes):
        async def chunks():
            yield head
            for _ in range(256):  # 256 MiB at most: far past any cap, and the test still ends
                yield tail
                await asyncio.sleep(0)

        return StreamingResponse(chunks(), media_type="text/html", headers={"Content-Encoding": "gzip"})

    @app.get("/gzip-then-more")
    async def gzip_then_more():  # a whole gzip page, then bytes that never end
        return streamed(gzip.compress(b"<p>The Danube flows through Vienna.</p>"), b"\0" * 2**20)

    @app.get("/gzip-empty-blocks")
    async def gzip_empty_blocks():  # a gzip header, then deflate's empty stored blocks: no output
        return streamed(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff", b"\x00\x00\x00\xff\xff" * 2**18)

    @app.get("/p\u00e4ge")
    async def non_ascii_path():
        return HTMLResponse("<title>M\u00fcnchen</title><p>Die Isar flie\u00dft durch M\u00fcnchen.</p>")

    @app.get("/redirect-non-ascii")
    async def redirect_non_ascii():
        response = Response(status_code=302)
        response.raw_headers.append((b"location", "/p\u00e4ge".encode()))  # raw UTF-8, as servers send it
        return response

    return app
