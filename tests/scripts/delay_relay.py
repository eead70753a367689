"""A TCP relay that delays every byte by a fixed time: a slow link between test hosts.

This kernel has no `netem`, so a slowed link is a relay in its own network namespace:
TF_CONFIG names the relay's address for a worker, and every connection to it is passed
on to the worker, each chunk in both directions held back `--delay_ms` (order kept).
Usage:
  delay_relay.py --delay_ms D LISTEN_HOST:PORT=TARGET_HOST:PORT [...]
Prints "ready" once every listener is up, then "connection to HOST:PORT" for each one.
"""

import argparse
import asyncio


async def _forward(reader, writer, delay: float) -> None:
    """Copies reader to writer, each chunk `delay` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def take():
        try:
            while data := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay, data))
        except ConnectionError:
            pass
        queue.put_nowait((loop.time() + delay, b""))

    async def give():
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    await asyncio.gather(take(), give())


def _serve(target: tuple[str, int], delay: float):
    async def on_connection(reader, writer):
        print(f"connection to {target[0]}:{target[1]}", flush=True)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _forward(reader, upstream_writer, delay), _forward(upstream_reader, writer, delay)
        )

    return on_connection


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay_ms", type=float, required=True)
    parser.add_argument("routes", nargs="+", help="LISTEN_HOST:PORT=TARGET_HOST:PORT")
    args = parser.parse_args()
    servers = []
    for route in args.routes:
        listen, target = route.split("=")
        handler = _serve(_address(target), args.delay_ms / 1000)
        servers.append(await asyncio.start_server(handler, *_address(listen)))
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


if __name__ == "__main__":
    asyncio.run(main())
