import pytest
from shop.cart import Cart, bulk_discount, total_due


def test_subtotal_sums_lines():
    cart = Cart()
    cart.add("apple", 30, 3)
    cart.add("pear", 45)
    assert cart.subtotal() == 135


def test_same_sku_merges():
    cart = Cart()
    cart.add("apple", 30)
    cart.add("apple", 30, 2)
    assert len(cart.lines) == 1
    assert cart.item_count() == 3


def test_quantity_must_be_positive():
    with pytest.raises(ValueError):
        Cart().add("apple", 30, 0)


def test_bulk_discount_from_threshold():
    cart = Cart()
    cart.add("nail", 100, 10)
    assert bulk_discount(cart) == 50
    cart.lines[0].quantity = 9
    assert bulk_discount(cart) == 0


def test_total_due_never_negative():
    cart = Cart()
    cart.add("gum", 80)
    assert total_due(cart, coupon=50) == 30
    assert total_due(cart, coupon=500) == 0
