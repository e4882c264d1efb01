"""The LangGraph peer of `subagents bench`: the same subagent runs as a LangGraph ReAct graph.

Each run is one thread of a compiled `StateGraph` (an agent node calling the model, a ToolNode
running `echo`, looping until the model answers) with PostgreSQL's checkpointer
(`AsyncPostgresSaver` on a connection pool) and `durability="sync"`: every super-step's
checkpoint is committed before the next step starts, as `subagents` commits every step. The
model is the same mock (`subagents mock-llm`), given the same scenario line, so both make the
same model calls. Prints one JSON line: runs, steps, seconds, steps/s, and how many runs
answered as the scenario says.

    python scripts/langgraph_peer.py --base-url http://127.0.0.1:18090/v1 \
        --dsn postgres://postgres@127.0.0.1/sa_lgpeer --runs 500 --steps 5 --concurrency 64

Run through `scripts/bench-langgraph.sh`, which installs the pinned packages and runs
`subagents bench` on the same mock and database server right after.
"""

import argparse
import asyncio
import json
import time
import uuid

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool


@tool
def echo(text: str = "") -> str:
    """Returns its text."""
    return text


def graph(base_url: str):
    model = ChatOpenAI(
        model="mock-model", base_url=base_url, api_key="unused", max_retries=0, timeout=60
    ).bind_tools([echo])

    async def agent(state: MessagesState):
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode([echo]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--dsn", required=True)
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64)
    a = p.parse_args()

    async with AsyncConnectionPool(
        a.dsn,
        min_size=min(a.concurrency, 8),
        max_size=a.concurrency,
        kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
        open=False,
    ) as pool:
        await pool.open(wait=True)
        saver = AsyncPostgresSaver(pool)
        await saver.setup()
        app = graph(a.base_url).compile(checkpointer=saver)
        tag = uuid.uuid4().hex
        gate = asyncio.Semaphore(a.concurrency)

        async def one(i: int) -> bool:
            async with gate:
                out = await app.ainvoke(
                    {
                        "messages": [
                            (
                                "user",
                                f"Subagent task {i}.\nSCENARIO steps={a.steps} tool=echo run={tag}-{i}",
                            )
                        ]
                    },
                    {"configurable": {"thread_id": f"{tag}-{i}"}, "recursion_limit": 4 * a.steps + 10},
                    durability="sync",
                )
                return out["messages"][-1].content == f"DONE after {a.steps} steps"

        # Warm-up: connections, the model client, the graph.
        for i in range(2):
            await one(-1 - i)
        t0 = time.perf_counter()
        ok = await asyncio.gather(*(one(i) for i in range(a.runs)))
        secs = time.perf_counter() - t0
    steps = a.runs * a.steps
    print(
        json.dumps(
            {
                "peer": "langgraph",
                "runs": a.runs,
                "steps": steps,
                "seconds": round(secs, 3),
                "steps_per_s": round(steps / secs, 1),
                "answered": sum(ok),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
