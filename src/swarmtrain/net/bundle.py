"""Several hand-off messages to one peer as one `bundle` message, and its reply as one bundle too.

With request batching on, a stage server computes several micro-batches in one call and then hands each
output to the next stage of its route (net/hand_off.py). Those that go to the same peer travel as one
`bundle`: one RPC instead of one per micro-batch, which on a small micro-batch costs more CPU than the
compute (stream set-up through the daemon, protobuf, asyncio). The receiver answers each item with the
handler of its kind, as if it had come alone, and replies with one bundle of their answers in order;
so every rule of a single request (validation, step admission, at-most-once accumulation, timeouts)
holds per item.

Layout: the bundle's header lists the items' headers, each with its `kind`; item i's tensor `name`
travels as `i.name`. A private run's membership token is checked once, on the bundle.
"""

from __future__ import annotations

from swarmtrain.net.protocol import BUNDLE_KIND, Message, ProtocolError

MAX_BUNDLE_ITEMS = 16


def bundle_message(items: list[Message], stage: int) -> Message:
    """One message carrying `items` (sent to a server of `stage`, or answered by one)."""
    if not 1 <= len(items) <= MAX_BUNDLE_ITEMS:
        raise ValueError(f"a bundle holds 1 to {MAX_BUNDLE_ITEMS} messages, got {len(items)}")
    headers = [{**item.header, "kind": item.kind} for item in items]
    tensors = {f"{i}.{name}": t for i, item in enumerate(items) for name, t in item.tensors.items()}
    return Message(BUNDLE_KIND, {"stage": stage, "items": headers}, tensors)


def split_bundle(message: Message, kinds: tuple[str, ...]) -> list[Message]:
    """The items of a bundle, each of one of `kinds`; ProtocolError if anything is malformed."""
    headers = message.header.get("items")
    if not (isinstance(headers, list) and 1 <= len(headers) <= MAX_BUNDLE_ITEMS):
        raise ProtocolError(f"a bundle lists 1 to {MAX_BUNDLE_ITEMS} items")
    items = []
    for header in headers:
        if not isinstance(header, dict) or header.get("kind") not in kinds:
            raise ProtocolError(f"a bundle carries only {', '.join(kinds)} messages")
        body = {k: v for k, v in header.items() if k != "kind"}
        items.append(Message(header["kind"], body, {}))
    for name, tensor in message.tensors.items():
        index, _, own_name = name.partition(".")
        if not (index.isdigit() and int(index) < len(items) and own_name):
            raise ProtocolError(f"bundle tensor {name[:80]!r} names no item")
        items[int(index)].tensors[own_name] = tensor
    return items
