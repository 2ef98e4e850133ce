"""An environment in its own process, speaking the env protocol with no rlpipe code.

It depends on a NATS client and a msgpack codec only (here nats-py and msgspec's msgpack;
any language with both can do the same). The environment, `notes`, offers one tool,
`add_note {"text": str}`, and ends the episode on a final answer (a step without tool
calls), reporting how many notes were taken.

    python examples/external_env.py nats://127.0.0.1:4222

The wire contract: docs/environments.md ("External processes") and proto/schema/*.json.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import msgspec
import nats

ENV = "notes"
QUEUE = "env-gateway"
SCHEMA_HEADER = "Rlpipe-Schema"
TOOLS = [
    {
        "name": "add_note",
        "description": "Stores a note.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
]

episodes: dict[str, list[str]] = {}  # episode id -> notes taken


def on_reset(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    episode_id = request["episode_id"]
    episodes.setdefault(episode_id, [])  # a repeated reset reopens the same episode
    prompt = request["task"]["prompt"]
    return "env_reset_reply/1", {
        "episode_id": episode_id,
        "messages": [{"role": "user", "content": prompt}],
        "tools": TOOLS,
        "max_turns": 4,
        "max_tokens": 64,
    }


def on_step(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    episode_id = request["episode_id"]
    if episode_id not in episodes:
        return "env_step_reply/1", {
            "episode_id": episode_id,
            "error": "unknown_episode",
            "error_message": f"episode {episode_id} is not open",
        }
    notes = episodes[episode_id]
    calls = request.get("tool_calls") or []
    if not calls:  # the final answer
        del episodes[episode_id]
        return "env_step_reply/1", {
            "episode_id": episode_id,
            "done": True,
            "info": {"num_notes": len(notes), "answer": request["action"]},
        }
    results = []
    for call in calls:
        text = call.get("arguments", {}).get("text")
        if call["name"] != "add_note" or not isinstance(text, str):
            results.append(
                {
                    "call_id": call["call_id"],
                    "name": call["name"],
                    "content": "add_note needs a string 'text'",
                    "error": "bad_arguments",
                }
            )
            continue
        notes.append(text)
        results.append(
            {"call_id": call["call_id"], "name": call["name"], "content": f"{len(notes)} notes"}
        )
    return "env_step_reply/1", {"episode_id": episode_id, "tool_results": results}


def on_close(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    closed = episodes.pop(request["episode_id"], None) is not None
    return "env_close_reply/1", {"episode_id": request["episode_id"], "closed": closed}


async def main(url: str) -> None:
    nc = await nats.connect(url)
    handlers = {"reset": on_reset, "step": on_step, "close": on_close}
    for op, handler in handlers.items():

        async def answer(msg: Any, handler: Any = handler) -> None:
            schema, reply = handler(msgspec.msgpack.decode(msg.data))
            body = msgspec.msgpack.encode(reply)
            await nc.publish(msg.reply, body, headers={SCHEMA_HEADER: schema})

        await nc.subscribe(f"rl.env.{ENV}.{op}", queue=QUEUE, cb=answer)
    await nc.flush()  # the server holds the subscriptions before we say we serve
    print(f"serving env {ENV!r} on {url}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222"))
