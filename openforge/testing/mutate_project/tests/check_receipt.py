from shop.cart import Cart
from shop.receipt import RULE, first_words, money, receipt


def test_money():
    assert money(1234) == "12.34"
    assert money(5) == "0.05"
    assert money(-250) == "-2.50"


def test_first_words():
    assert first_words("a b c d", 2) == "a b"


def test_receipt_rows():
    cart = Cart()
    cart.add("tea", 250, 2)
    rows = receipt(cart, width=16)
    assert rows == ["2 x tea     5.00", "=" * 16]


def test_default_rule():
    assert RULE == "=" * 24
    assert receipt(Cart())[-1] == RULE
