"""shared.streams.outcomes: a failure that is the entry's own dead-letters it, any other releases it."""

from __future__ import annotations

from shared.redis_conn import RedisRetry
from shared.streams import Delivery
from shared.streams.outcomes import DeliveryOutcomes, failure_reason


class BadEntry(ValueError):
    pass


class FakeConsumer:
    """Records what a StreamConsumer would be asked to do with a delivery."""

    def __init__(self) -> None:
        self.dead: list[tuple[str, str]] = []
        self.released: list[tuple[str, str, bool]] = []

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self.dead.append((delivery.record_id, reason))

    async def release(self, delivery: Delivery, error: str, *, at_once: bool = False) -> None:
        self.released.append((delivery.record_id, error, at_once))


def _outcomes() -> tuple[DeliveryOutcomes, FakeConsumer]:
    consumer = FakeConsumer()
    return DeliveryOutcomes(consumer, RedisRetry(), "a prompt", rejects=(BadEntry,)), consumer  # type: ignore[arg-type]


def _delivery(record_id: str = "r1") -> Delivery:
    return Delivery("1-0", record_id, b"payload", 1)


async def test_an_error_named_as_the_entrys_own_dead_letters_it():
    outcomes, consumer = _outcomes()
    assert await outcomes.settle(_delivery(), BadEntry("prompt too long")) == "rejected"
    assert consumer.dead == [("r1", "BadEntry: prompt too long")]
    assert consumer.released == []


async def test_any_other_error_releases_the_entry_and_never_dead_letters_it():
    outcomes, consumer = _outcomes()
    assert await outcomes.settle(_delivery(), ConnectionError("reward service down")) == "released"
    assert consumer.released == [("r1", "ConnectionError: reward service down", False)]
    assert consumer.dead == []


async def test_a_subclass_of_a_rejected_type_is_rejected_too():
    class TooLong(BadEntry):
        pass

    outcomes, consumer = _outcomes()
    assert await outcomes.settle(_delivery(), TooLong("x")) == "rejected"
    assert [record_id for record_id, _ in consumer.dead] == ["r1"]


async def test_a_release_with_a_reason_in_words_keeps_it_and_may_hand_back_at_once():
    outcomes, consumer = _outcomes()
    await outcomes.release(_delivery(), "the weights went back", at_once=True)
    assert consumer.released == [("r1", "the weights went back", True)]


async def test_a_rejection_redacts_the_error_but_keeps_a_reason_in_words():
    outcomes, consumer = _outcomes()
    await outcomes.reject(_delivery("a"), ValueError("redis://user:secret@host:6379 refused"))
    await outcomes.reject(_delivery("b"), "required reward failing for 1800 s")
    assert "secret" not in consumer.dead[0][1]
    assert consumer.dead[1] == ("b", "required reward failing for 1800 s")


def test_failure_reason_names_the_error_type():
    assert failure_reason(KeyError("x")) == "KeyError: 'x'"
    assert failure_reason("in words") == "in words"
