"""The router's admin API, as the sync uses it. Two dialects, told apart by the router's answer:

- vllm-router (0.1.17): `GET /list_workers`, `POST /add_worker?url=U` (a regular worker), `POST
  /workers` with `{"url", "model_id", "worker_type": "prefill"|"decode"}` (a router started with
  `--enable-igw`, the only mode of vllm-router 0.1.17 whose admin API takes a worker's model or
  type), `POST /remove_worker?url=U`. A plain add polls the worker's /health inside the router (a
  `/workers` add does not: measured, it accepts a URL nothing answers).
- SGLang's gateway (`sglang-router` 0.3; it answers `/list_workers` 404): `GET /workers`, `POST
  /workers` with `{"url", "model_id", "worker_type"}` (queued: 202, the worker appears once the
  gateway has checked it, so a worker it cannot reach is simply missing at the next re-list, which
  adds it again), `DELETE /workers/{id}` (by the id the list gives).

Every call has a deadline: Motor lists only engines that already serve, an add that takes long
means the router is in trouble. A router that does not answer (refused connection, timeout, 5xx)
is `RouterDown`; a 4xx about one worker is `Refused`, with the router's answer.
"""

from __future__ import annotations

import httpx

ALREADY_THERE = "already exists"  # the router's 400 for a worker it has: what was asked holds


class RouterDown(Exception):
    """The router did not answer, or answered with a server error."""


class Refused(Exception):
    """The router refused a change about one worker; `answer` is what it said."""

    def __init__(self, url: str, status: int, answer: str):
        super().__init__(f"the router refused worker {url}: HTTP {status}: {answer}")
        self.url, self.status, self.answer = url, status, answer


class RouterAdmin:
    def __init__(self, base_url: str, timeout: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self.client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)
        self.gateway = False  # SGLang's gateway dialect, learnt from the first list
        self._ids: dict[str, str] = {}  # the gateway's worker id of each URL, from the last list

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(
        self, method: str, path: str, params: dict | None = None, json: dict | None = None
    ) -> httpx.Response:
        try:
            response = await self.client.request(method, path, params=params, json=json)
        except httpx.HTTPError as exc:
            raise RouterDown(f"{self.base_url}: {type(exc).__name__}: {exc or 'no answer'}") from exc
        if response.status_code >= 500 or response.status_code in (401, 403):
            # 401/403: not about one worker (a router guarding its API): every call would be refused.
            raise RouterDown(f"{self.base_url}{path}: HTTP {response.status_code}: {response.text[:200]}")
        return response

    async def workers(self) -> set[str]:
        if not self.gateway:
            response = await self._call("GET", "/list_workers")
            if response.status_code == 404:  # SGLang's gateway: it lists at /workers
                self.gateway = True
            else:
                return set(self._listed(response, "/list_workers", lambda body: body["urls"]))
        response = await self._call("GET", "/workers")
        listed = self._listed(response, "/workers", lambda body: [(w["url"], w["id"]) for w in body["workers"]])
        self._ids = dict(listed)
        return set(self._ids)

    def _listed(self, response: httpx.Response, path: str, read) -> list:
        if response.status_code != 200:
            raise RouterDown(f"{self.base_url}{path}: HTTP {response.status_code}: {response.text[:200]}")
        try:
            return list(read(response.json()))
        except (ValueError, KeyError, TypeError):
            raise RouterDown(f"{self.base_url}{path}: not a worker list: {response.text[:200]}") from None

    async def add(self, url: str, worker_type: str | None = None, model: str | None = None) -> None:
        try:
            if worker_type or model or self.gateway:
                typed = {"worker_type": worker_type} if worker_type else {}
                named = {"model_id": model} if model else {}
                response = await self._call("POST", "/workers", json={"url": url, **typed, **named})
            else:
                response = await self._call("POST", "/add_worker", {"url": url})
        except RouterDown as exc:
            # The router waits for the worker's /health before it answers: a slow add is about
            # this worker (the list call before it was answered), not a router down.
            if isinstance(exc.__cause__, httpx.TimeoutException):
                raise Refused(
                    url,
                    0,
                    f"no answer within {self.client.timeout.read:g}s (the router polls the worker's /health first)",
                ) from None
            raise
        if response.status_code >= 400 and ALREADY_THERE not in response.text:
            raise Refused(url, response.status_code, response.text[:300])

    async def remove(self, url: str) -> None:
        if self.gateway:
            if url not in self._ids:
                await self.workers()
            if url not in self._ids:
                return  # gone already
            response = await self._call("DELETE", f"/workers/{self._ids.pop(url)}")
        else:
            response = await self._call("POST", "/remove_worker", {"url": url})
        if response.status_code >= 400 and "not found" not in response.text.lower():
            raise Refused(url, response.status_code, response.text[:300])
