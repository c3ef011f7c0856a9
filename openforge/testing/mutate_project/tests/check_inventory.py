import pytest
from shop.inventory import Inventory, OutOfStock


def test_receive_and_take():
    inv = Inventory()
    inv.receive("bolt", 5)
    inv.receive("bolt", 2)
    assert inv.take("bolt", 4) == 3


def test_take_too_many():
    inv = Inventory()
    inv.receive("bolt", 1)
    with pytest.raises(OutOfStock):
        inv.take("bolt", 2)
    assert inv.take("bolt", 1) == 0


def test_low_stock():
    inv = Inventory()
    inv.receive("b", 2)
    inv.receive("a", 1)
    inv.receive("c", 3)
    assert inv.low() == ["a", "b"]


def test_empty():
    inv = Inventory()
    assert inv.is_empty()
    inv.receive("x", 1)
    assert not inv.is_empty()
