"""Assets for running SkyRL's shipped text environments (``skyrl_gym`` 0.4: ``gsm8k``, ``gsm8k_multi_turn``,
``aime``, ``text2sql``, ``lcb``, ``search``, ``searchcode``) on one machine, without their datasets or services:

- :func:`build_spider_db`: a tiny SQLite database where ``text2sql`` looks for a Spider one;
- :class:`RetrievalServer`: a stdlib HTTP retriever speaking the protocol of ``skyrl_gym.tools.search``
  (what ``search`` and ``searchcode`` call), on 127.0.0.1;
- :func:`env_rows` / :func:`write_prompt_parquet`: prompt rows in SkyRL's dataset schema, one parquet file that
  ``mlora.rollout.data.load_prompts`` reads back; :func:`env_settings`: the ``environment.skyrl_gym.<id>``
  dicts the environments need;
- :func:`scripted_turns`: what a model writes, turn by turn, to call each environment's tool and answer
  correctly in the form the environment's own parser accepts.
"""

from __future__ import annotations

import json
import re
import socketserver
import sqlite3
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable, NamedTuple

ENV_IDS = ("gsm8k", "gsm8k_multi_turn", "aime", "text2sql", "lcb", "search", "searchcode")

# ---------------------------------------------------------------------------------------------- text2sql

SPIDER_DB_ID = "concert_singer"
SINGERS = [(1, "Joe Sharp", "Netherlands", 52), (2, "Timbaland", "United States", 32),
           (3, "Justin Brown", "France", 29), (4, "Rose White", "France", 41)]
CONCERTS = [(1, "Auditions", 2014, 1), (2, "Super bootcamp", 2014, 4), (3, "Home Visits", 2015, 2)]
SQL_QUESTION = "What are the names of the singers older than 40?"
SQL_GOLD = "SELECT name FROM singer WHERE age > 40"
SQL_OLDER_THAN_40 = [name for _, name, _, age in SINGERS if age > 40]


class SpiderDB(NamedTuple):
    db_path: Path  # environment.skyrl_gym.text2sql.db_path
    db_id: str  # a row's db_id
    db_file: Path


def build_spider_db(root: Path, db_id: str = SPIDER_DB_ID) -> SpiderDB:
    """A two-table SQLite database (``singer``, ``concert``: :data:`SINGERS`, :data:`CONCERTS`) in the layout
    SQLEnv reads for a row with ``data="spider"``: ``<db_path>/spider/database/<db_id>/<db_id>.sqlite``
    (``data="synsql"`` would read ``SynSQL-2.5M/databases/...``, ``"bird"`` ``bird/train/train_databases/...``).
    ``root`` becomes ``db_path``."""
    root = Path(root)
    folder = root / "spider" / "database" / db_id
    folder.mkdir(parents=True, exist_ok=True)
    db_file = folder / f"{db_id}.sqlite"
    db_file.unlink(missing_ok=True)
    with sqlite3.connect(db_file) as conn:
        conn.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
        conn.execute("CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, concert_name TEXT, year INTEGER, "
                     "singer_id INTEGER REFERENCES singer(singer_id))")
        conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
        conn.executemany("INSERT INTO concert VALUES (?, ?, ?, ?)", CONCERTS)
    conn.close()  # the context manager commits but leaves the connection open
    return SpiderDB(root, db_id, db_file)


SQL_SCHEMA = """Table: singer
- singer_id (INTEGER, PRIMARY KEY)
- name (TEXT)
- country (TEXT)
- age (INTEGER)
Table: concert
- concert_id (INTEGER, PRIMARY KEY)
- concert_name (TEXT)
- year (INTEGER)
- singer_id (INTEGER, FOREIGN KEY -> singer.singer_id)"""

# ------------------------------------------------------------------------------------------- retrieval

DOCUMENTS = [
    {"id": "0", "contents": "Paris is the capital and most populous city of France, on the river Seine."},
    {"id": "1", "contents": "Berlin is the capital of Germany and its largest city by population."},
    {"id": "2", "contents": "Multiplication table: six times seven equals forty-two."},
    {"id": "3", "contents": "The Seine flows through Paris into the English Channel at Le Havre."},
]


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def rank_documents(query: str, documents: list[dict], topk: int) -> list[tuple[dict, float]]:
    """The ``topk`` documents by how many of the query's words they contain (ties in corpus order), with that
    count as the score; like a dense retriever, always ``topk`` of them."""
    words = _words(query)
    scored = [(doc, float(len(words & _words(doc["contents"])))) for doc in documents]
    return sorted(scored, key=lambda item: -item[1])[:max(int(topk), 0)]


class _HTTPServer(ThreadingHTTPServer):
    def server_bind(self) -> None:
        # HTTPServer's own resolves the host's name (socket.getfqdn), a DNS query where /etc/hosts lacks it
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class RetrievalServer:
    """SkyRL's example retriever (``examples/search/retriever/retrieval_server.py``) in miniature: ``POST
    /retrieve`` with JSON ``{"query": str}`` (what skyrl_gym 0.4's ``call_search_api`` sends) or ``{"queries":
    [str, ...]}`` (the example server's and Search-R1's field), ``"topk"`` and ``"return_scores"``; it answers
    ``{"result": [<per query: [{"document": {"id", "contents"}, "score": float}, ...]>]}`` (without scores:
    the documents themselves, as the example server does; SearchToolGroup always asks for scores).

    On 127.0.0.1, an ephemeral port unless ``port`` is given; ``url`` is ``search_url``. Every request body it
    parsed is kept in ``requests``. Use as a context manager, or ``start()``/``stop()``."""

    def __init__(self, documents: list[dict] | None = None, port: int = 0, default_topk: int = 3) -> None:
        self.documents = list(DOCUMENTS if documents is None else documents)
        self.default_topk = default_topk
        self.requests: list[dict] = []
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the retrieval server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/retrieve"

    def answer(self, body: Any) -> tuple[int, dict]:
        """Status and JSON reply for one request body."""
        if not isinstance(body, dict):
            return 422, {"detail": "the body must be a JSON object"}
        if isinstance(body.get("query"), str):
            queries = [body["query"]]
        elif isinstance(body.get("queries"), list) and all(isinstance(q, str) for q in body["queries"]):
            queries = body["queries"]
        else:
            return 422, {"detail": "expected 'query' (a string) or 'queries' (a list of strings)"}
        topk = body.get("topk") or self.default_topk
        scores = bool(body.get("return_scores", False))
        result = []
        for query in queries:
            ranked = rank_documents(query, self.documents, topk)
            result.append([{"document": doc, "score": score} if scores else doc for doc, score in ranked])
        return 200, {"result": result}

    def start(self) -> "RetrievalServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: one request per connection, so that no keep-alive connection of requests' shared
            # session holds a handler thread when the server stops
            protocol_version = "HTTP/1.0"

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.rstrip("/") != "/retrieve":
                    return self._reply(404, {"detail": "Not Found"})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                except json.JSONDecodeError as exc:
                    return self._reply(422, {"detail": f"invalid JSON: {exc}"})
                server.requests.append(body)
                self._reply(*server.answer(body))

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — quiet test output
                pass

        self._httpd = _HTTPServer(("127.0.0.1", self._port), Handler)
        # a short poll so that stop() returns at once rather than after serve_forever's default half second
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="retrieval-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        self._httpd, self._thread = None, None

    def __enter__(self) -> "RetrievalServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# SkyRL's SearchToolGroup() default, which searchcode always uses (it does not read env_config)
SEARCHCODE_PORT = 8000

# ------------------------------------------------------------------------------------------- prompt rows

SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as you want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: ")

SQL_SYSTEM = (
    "You are a data science expert. Below, you are provided with a database schema and a natural language "
    "question. Conduct thinking inside <think>...</think> blocks every time you get new observation or "
    "information. You can use SQL tool written within a single <sql>your sql</sql> block to explore or verify; "
    "its output is shown inside <observation>...</observation>. Then give the final SQL query inside "
    "<solution>...</solution>.")

LCB_STDIN_TESTS = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
                   {"input": "10 -4\n", "output": "6\n", "testtype": "stdin"}]
LCB_FUNCTIONAL_TESTS = [{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]", "testtype": "functional",
                         "metadata": {"func_name": "twoSum"}},
                        {"input": "[3, 2, 4]\n6", "output": "[1, 2]", "testtype": "functional",
                         "metadata": {"func_name": "twoSum"}}]


def _rule(ground_truth: Any) -> dict:
    return {"method": "rule", "ground_truth": ground_truth}


def _user(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def env_rows(env_ids: Iterable[str] = ENV_IDS, db_id: str = SPIDER_DB_ID) -> list[dict]:
    """Prompt rows in SkyRL's dataset schema (``data_source``, chat ``prompt``, ``env_class``, ``reward_spec``
    ``{"method": "rule", "ground_truth": ...}``, ``extra_info``), plus what each environment reads from its
    extras: ``text2sql`` ``db_id`` and ``data`` ("spider"); ``aime`` ``reward_model`` (AIMEEnv reads the answer
    there, not in reward_spec); ``lcb`` a ground truth that is a JSON string of test cases. One row per id,
    ``lcb`` two (stdin and LeetCode-style functional tests); each row's ``data_source`` is unique and names its
    :func:`scripted_turns`."""
    gsm8k = "Let's think step by step and output the final answer after \"####\"."
    rows = {
        "gsm8k": [dict(data_source="openai/gsm8k", prompt=_user(
            "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
            f"many clips did Natalia sell altogether in April and May? {gsm8k}"), env_class="gsm8k",
            reward_spec=_rule("72"))],
        "gsm8k_multi_turn": [dict(data_source="gsm8k_multi_turn", prompt=_user(
            f"A box holds 6 rows of 7 eggs. How many eggs does it hold? {gsm8k}"), env_class="gsm8k_multi_turn",
            reward_spec=_rule("42"))],
        "aime": [dict(data_source="aime", prompt=_user(
            "Find the remainder when 2^10 is divided by 1000. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem."), env_class="aime",
            reward_spec=_rule("24"), reward_model=_rule("24"))],
        "text2sql": [dict(data_source="spider", prompt=_user(
            f"{{db_details}}:{SQL_SCHEMA};\n {{external_knowledge}}: ;\n {{question}}: {SQL_QUESTION}", SQL_SYSTEM),
            env_class="text2sql", reward_spec=_rule(SQL_GOLD), db_id=db_id, data="spider")],
        "lcb": [dict(data_source="lcb_stdin", prompt=_user(
            "Read two integers A and B from one line of standard input and print A + B. Write Python in a "
            "```python code block."), env_class="lcb", reward_spec=_rule(json.dumps(LCB_STDIN_TESTS))),
                dict(data_source="lcb_functional", prompt=_user(
                    "Given an array nums and an integer target, return the indices of the two numbers that add up "
                    "to target.\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:"
                    "\nWrite Python in a ```python code block."), env_class="lcb",
                    reward_spec=_rule(json.dumps(LCB_FUNCTIONAL_TESTS)))],
        "search": [dict(data_source="searchR1_nq", prompt=_user(
            SEARCH_R1_PREFIX + "what is the capital of france?", "You are a helpful and harmless assistant."),
            env_class="search", reward_spec=_rule({"target": ["Paris"]}))],
        "searchcode": [dict(data_source="searchcode", prompt=_user(
            "What is six times seven? You can call <tool><search>query</search></tool> or "
            "<tool><python>code</python></tool>; give the final answer as <solution>#### N</solution>."),
            env_class="searchcode", reward_spec=_rule("42"))],
    }
    unknown = [e for e in env_ids if e not in rows]
    if unknown:
        raise ValueError(f"no rows for {unknown}; known: {list(rows)}")
    out = [row for e in env_ids for row in rows[e]]
    for i, row in enumerate(out):
        row["extra_info"] = {"split": "train", "index": i}
    return out


def write_prompt_parquet(rows: list[dict], path: Path) -> Path:
    """``rows`` as one parquet file for ``data.train_data``: ``reward_spec`` as JSON text, since its
    ``ground_truth`` is a string in some environments and a dict in ``search`` (one parquet column holds one
    type; ``mlora.rollout.data.load_prompts`` decodes it). Columns a row lacks are null in it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist would take the first row's keys only
    table = pa.Table.from_pylist([{**{c: r.get(c) for c in columns}, "reward_spec": json.dumps(r["reward_spec"])}
                                  for r in rows])
    pq.write_table(table, path)
    return path


def env_settings(db_root: Path | str, server_url: str) -> dict[str, dict]:
    """``environment.skyrl_gym.<id>`` for the environments that read settings: ``text2sql.db_path`` (the root
    :func:`build_spider_db` made) and ``search.search_url`` (its other keys keep SkyRL's defaults: topk 3, timeout
    30). The others read none; ``searchcode`` ignores its settings (its search tool is pinned to
    ``http://127.0.0.1:8000/retrieve``)."""
    return {"text2sql": {"db_path": str(db_root)}, "search": {"search_url": server_url}}


# -------------------------------------------------------------------------------------------- scripts

_SCRIPTS = {
    # GSM8kEnv: one turn, strict "#### N" (regex "#### (-?[0-9.,]+)": one space, compared as text)
    "openai/gsm8k": ["Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 in all.\n#### 72"],
    # GSM8kMultiTurnEnv: a well-formed wrong answer scores 0.2 / max_turns and asks again; a right one ends it
    "gsm8k_multi_turn": ["6 + 7 = 13.\n#### 13", "6 rows of 7 is 6 * 7 = 42.\n#### 42"],
    # AIMEEnv: "Answer: X" (Minerva's pattern), normalised; a bare \boxed{24} is not read
    "aime": ["2^10 = 1024 and 1024 = 1000 + 24.\nAnswer: \\boxed{24}"],
    # SQLEnv: <sql> runs on the db; <solution> ends it. The reward reads the whole history: <think> somewhere,
    # one <solution>, and after every </observation> the next text must start with <think>
    "spider": ["<think>Look at the singers older than 40 first.</think>\n<sql>SELECT name, age FROM singer "
               "WHERE age > 40</sql>",
               f"<think>Those are the singers asked for; only their names are wanted.</think>\n"
               f"<solution>{SQL_GOLD}</solution>"],
    # LCBEnv: one turn, the last ```lang\n...``` block runs against the tests in a subprocess
    "lcb_stdin": ["Read the line, add, print.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"],
    "lcb_functional": ["A dictionary of seen values.\n```python\nclass Solution:\n"
                       "    def twoSum(self, nums, target):\n        seen = {}\n"
                       "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
                       "                return [seen[target - x], i]\n            seen[x] = i\n```"],
    # SearchEnv: <search> calls the retriever; <answer> ends it, exact match (normalised) against
    # ground_truth["target"]
    "searchR1_nq": ["<think>I need the capital of France.</think>\n<search>capital of France</search>",
                    "<think>The documents say Paris.</think>\n<answer>Paris</answer>"],
    # SearchCodeEnv: <tool><python>..</python></tool> runs `python -c` (the `python` on PATH), stdout back;
    # <solution> ends it, scored as strict gsm8k over the whole history
    "searchcode": ["<tool><python>print(f'product={6 * 7}')</python></tool>", "<solution>#### 42</solution>"],
}
SEARCHCODE_SEARCH_TURN = "<tool><search>six times seven</search></tool>"  # needs a retriever on port 8000
_FIRST = {"gsm8k": "openai/gsm8k", "gsm8k_multi_turn": "gsm8k_multi_turn", "aime": "aime", "text2sql": "spider",
          "lcb": "lcb_stdin", "search": "searchR1_nq", "searchcode": "searchcode"}


def scripted_turns(name: str) -> list[str]:
    """A model's turns that use the environment's tool and answer correctly: ``name`` is a row's
    ``data_source`` (:func:`env_rows`) or an environment id (its first row)."""
    key = _FIRST.get(name, name)
    if key not in _SCRIPTS:
        raise ValueError(f"no scripted turns for {name!r}; known: {sorted(set(_FIRST) | set(_SCRIPTS))}")
    return list(_SCRIPTS[key])
