from solution import Account


def test_deposit():
    account = Account()
    account.deposit(5)
    assert account.balance == 5
