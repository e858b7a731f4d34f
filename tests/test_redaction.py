from dflash_queue.redaction import redact


def test_passwords_are_masked_and_nothing_else_changes():
    assert redact("redis://:hunter2@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("redis://user:pw@host/1") == "redis://user:***@host/1"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
    assert redact("s3://bucket/prefix") == "s3://bucket/prefix"
