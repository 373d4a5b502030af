"""Fault drills against the checked KV pool: a fault injector and a small workload with one fault.

Kept out of the runtime: they reach into a live engine the way a bug would, through its public parts
(block manager, runner, pool memory). Used by the tests and `kvq bench integrity`.
"""
