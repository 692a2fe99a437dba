"""Pure decisions on plain data: placement cost model and search, routing (IWRR), rebalancing.

No torch, no hivemind: the live runtime and the simulator call the same functions.
"""
