"""A small shop whose checkout is a saga: reserve stock, charge the card, send the receipt."""
