"""The monitor page in real headless Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium).

A 3-server swarm covers a 6-block model; the page shows it healthy. Killing the server of blocks 2:4 (no replica)
turns the coverage bar's blocks 2 and 3 red and the page says "missing blocks 2:4" within the servers' announce
period, long before its DHT record expires; `corolla status` agrees. A chat message typed into the page streams
back from an OpenAI-compatible endpoint, text appearing while the response is still open. Screenshots of each
state go to bench/results/.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import StreamingResponse

from conftest import SERVER_ARGS, make_llama_checkpoint
from corolla import AutoDistributedModelForCausalLM
from corolla.cli.local_swarm import LocalSwarm
from corolla.client.event_loop import get_loop, run_sync
from corolla.dht import create_swarm_node
from corolla.monitor.app import add_monitor_routes
from corolla.monitor.config import MonitorConfig
from corolla.monitor.source import SwarmMonitor
from monitor_helpers import SIX_BLOCKS, peer_id_from_log, running_monitor, wait_for

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
ANNOUNCE_PERIOD = 15.0  # seconds between the servers' announces; their records live 90 s
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--window-size=1200,1000",
]
FIRST_CHUNK, REST = "Hello", " from the swarm"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip("Chromium is not installed (apt-get install chromium chromium-driver; .ci/run installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def page_text(driver, selector: str) -> str | None:
    """textContent of the first element matching `selector` (read in the page: the poller replaces its nodes)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", selector)


def block_counts(driver) -> list[int]:
    return driver.execute_script(
        "return [...document.querySelectorAll('[data-testid=coverage-bar] .block')].map(b => Number(b.dataset.count));")


def screenshot(driver, name: str) -> None:
    """The page's content (header and cards, without the empty space below) as bench/results/NAME."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    assert driver.find_element("tag name", "body").screenshot(str(RESULTS / name)), f"no screenshot {name}"


def test_the_page_shows_coverage_live_and_streams_a_chat_reply(browser, tmp_path_factory):
    path = str(make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny6", initializer_range=0.2, **SIX_BLOCKS))
    log_path = tmp_path_factory.mktemp("logs") / "browser-swarm.log"
    with open(log_path, "w") as log, LocalSwarm(log_file=log, env={"COROLLA_CACHE": str(tmp_path_factory.mktemp("cache"))}) as local:
        peers = local.start_dht()
        procs = {blocks: local.start_server(path, ["--blocks", blocks, *SERVER_ARGS, "--announce-period", str(ANNOUNCE_PERIOD)],
                                            name=f"browser-{blocks}", wait=False) for blocks in ("0:2", "2:4", "4:6")}
        for proc in procs.values():
            local.wait_ready(proc)
        peer_ids = {blocks: peer_id_from_log(proc.tail(200)) for blocks, proc in procs.items()}

        with running_monitor(peers, "--refresh-period", "1") as monitor:
            browser.get(monitor.url)
            health = lambda: (page_text(browser, "[data-testid=health]"), block_counts(browser))  # noqa: E731
            wait_for(lambda: health() == ("healthy", [1] * 6), 60, describe=health)
            rows = browser.execute_script("return [...document.querySelectorAll('tr[data-peer-id]')].map(r => r.dataset.peerId);")
            assert sorted(rows) == sorted(peer_ids.values())
            generate_a_little(path, peers)  # some traffic, so the tokens/s chart has something to draw
            time.sleep(2.5)
            screenshot(browser, "monitor_covered.png")

            local.kill(procs["2:4"], signal.SIGKILL)  # blocks 2:4 have no replica
            killed = time.monotonic()
            wait_for(lambda: health()[0] == "missing blocks 2:4", 60, 0.1, health)
            seen_after = time.monotonic() - killed
            assert block_counts(browser) == [1, 1, 0, 0, 1, 1]
            state = page_text(browser, f"tr[data-peer-id='{peer_ids['2:4']}'] .pill")
            assert state == "unreachable"
            print(f"page showed 'missing blocks 2:4' {seen_after:.1f}s after the kill (announce period {ANNOUNCE_PERIOD:.0f}s)")
            assert seen_after < ANNOUNCE_PERIOD, f"took {seen_after:.1f}s"
            screenshot(browser, "monitor_missing.png")

        status = subprocess.run([sys.executable, "-m", "corolla.cli.main", "status", "--initial-peers", *peers, "--json"],
                                capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert status.returncode == 0, status.stderr
        [model] = json.loads(status.stdout)["models"]
        assert model["missing_ranges"] == ["2:4"]
        assert {s["peer_id"]: s["state"] for s in model["servers"]}[peer_ids["2:4"]] == "unreachable"

        with ChatPage(peers) as chat:
            browser.get(chat.url)
            wait_for(lambda: page_text(browser, "[data-testid=health]") == "missing blocks 2:4", 60)
            assert browser.execute_script("return document.getElementById('chat').hidden") is False
            browser.find_element("id", "chat-input").send_keys("How is the swarm?")
            browser.find_element("id", "chat-send").click()
            # the first chunk shows while the response is still open: the page renders the stream as it comes
            chat_log = lambda: browser.execute_script("return document.getElementById('chat-log').innerHTML")  # noqa: E731
            wait_for(lambda: page_text(browser, "#chat-log .msg.assistant .reply") == FIRST_CHUNK, 30, 0.05, chat_log)
            chat.release_rest.set()
            wait_for(lambda: page_text(browser, "#chat-log .msg.assistant .reply") == FIRST_CHUNK + REST, 30, 0.25, chat_log)
            screenshot(browser, "monitor_chat.png")
            [request] = chat.requests
            assert request["stream"] is True and request["model"] == "tiny6"
            assert request["messages"] == [{"role": "user", "content": "How is the swarm?"}]


def generate_a_little(path: str, peers: list[str]) -> None:
    model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=peers, torch_dtype=torch.float32)
    try:
        with model.inference_session(max_length=64) as session:
            model.generate(torch.tensor([[1, 17, 42, 99]]), max_new_tokens=24, session=session)
    finally:
        model.shutdown()


class ChatPage:
    """The monitor routes mounted with a chat box, as `corolla api` will serve them, in this process: the monitor
    refreshes on the client's shared event loop (where an API's model lives) while uvicorn serves from a loop of its
    own thread. The chat endpoint is a small OpenAI-style server-sent-event stream that holds its second chunk back
    until `release_rest` is set."""

    def __init__(self, initial_peers: list[str]):
        self.initial_peers = initial_peers
        self.url = ""
        self.requests: list[dict] = []
        self.release_rest = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="chat-page", daemon=True)
        self._node = None
        self._refresher = None

    def __enter__(self) -> ChatPage:
        self._node = run_sync(create_swarm_node(self.initial_peers, client_mode=True))
        self.monitor = SwarmMonitor(self._node, MonitorConfig(initial_peers=tuple(self.initial_peers), refresh_period=1.0))
        run_sync(self.monitor.refresh())
        self._refresher = asyncio.run_coroutine_threadsafe(self.monitor.run(), get_loop())
        self._thread.start()
        if not self._ready.wait(120) or self._error is not None:
            self.__exit__()
            raise AssertionError(f"chat page did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_rest.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._thread.join(60)
        if self._refresher is not None:
            self._refresher.cancel()
        if self._node is not None:
            run_sync(self._node.shutdown(), timeout=30)

    def _serve(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to the test thread
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "tiny6", "object": "model", "owned_by": "corolla"}]}

        @app.post("/v1/chat/completions")
        async def completions(request: Request) -> StreamingResponse:
            self.requests.append(await request.json())

            async def events():
                yield _event({"role": "assistant"})
                yield _event({"content": FIRST_CHUNK})
                await asyncio.to_thread(self.release_rest.wait, 60)
                yield _event({"content": REST})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        add_monitor_routes(app, self.monitor, chat_url="/v1/chat/completions")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(16)
            server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", lifespan="off"))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.02)
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
            self._ready.set()
            await self._stop.wait()
            server.should_exit = True
            await serving


def _event(delta: dict) -> str:
    chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "model": "tiny6",
             "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n"
