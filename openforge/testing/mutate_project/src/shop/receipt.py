"""Receipt text."""

from __future__ import annotations

from shop.cart import Cart


def money(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    cents = abs(cents)
    return f"{sign}{cents // 100}.{cents % 100:02d}"


def first_words(text: str, n: int) -> str:
    words = text.split()
    return " ".join(words[:n])


def rule(width: int) -> str:
    """The line under a receipt's items."""
    return "=" * width


WIDTH = 24
RULE = rule(WIDTH)  # the default receipt's, made when the module is imported


def receipt(cart: Cart, width: int = WIDTH) -> list[str]:
    rows = []
    for line in cart.lines:
        label = f"{line.quantity} x {line.sku}"
        amount = money(line.total())
        gap = width - len(label) - len(amount)
        rows.append(label + " " * max(gap, 1) + amount)
    rows.append(rule(width))
    return rows
