"""Carts: lines of (sku, unit price in cents, quantity) and what they cost."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Line:
    sku: str
    price: int
    quantity: int

    def total(self) -> int:
        return self.price * self.quantity


@dataclass
class Cart:
    lines: list[Line] = field(default_factory=list)

    def add(self, sku: str, price: int, quantity: int = 1) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        for line in self.lines:
            if line.sku == sku:
                line.quantity += quantity
                return
        self.lines.append(Line(sku, price, quantity))

    def subtotal(self) -> int:
        return sum(line.total() for line in self.lines)

    def item_count(self) -> int:
        count = 0
        for line in self.lines:
            count += line.quantity
        return count


def bulk_discount(cart: Cart, threshold: int = 10, percent: int = 5) -> int:
    """Cents off when the cart holds at least `threshold` items."""
    if cart.item_count() >= threshold:
        return cart.subtotal() * percent // 100
    return 0


def total_due(cart: Cart, coupon: int = 0) -> int:
    """What the customer pays: never below zero."""
    due = cart.subtotal() - bulk_discount(cart) - coupon
    return max(due, 0)
