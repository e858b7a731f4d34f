"""Captures share the vLLM extract engine; a canary rerun has it alone."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class EngineGate:
    """Captures share the engine; a canary rerun has it alone. `exclusive` waits until the captures holding the
    engine have finished and keeps new ones waiting (so a rerun cannot starve), then runs alone."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._condition:
            await self._condition.wait_for(lambda: not self._exclusive and not self._waiting_exclusive)
            self._shared += 1
        try:
            yield
        finally:
            async with self._condition:
                self._shared -= 1
                self._condition.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._condition:
            self._waiting_exclusive += 1
            try:
                await self._condition.wait_for(lambda: not self._exclusive and not self._shared)
            finally:
                self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._condition:
                self._exclusive = False
                self._condition.notify_all()
