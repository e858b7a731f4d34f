"""A broker behind Redis Sentinel in `[broker]`: the url listing the sentinels, broker.sentinel_master, the
sentinels' password, and what clients and Celery connect with."""

from __future__ import annotations

import pytest

from dflash_queue.config import PASSWORD_ENV, load_config
from dflash_queue.errors import ConfigError
from dflash_queue.queue.app import celery_settings
from dflash_queue.queue.config import SENTINEL_PASSWORD_ENV, SENTINEL_PASSWORD_FILE_ENV
from dflash_queue.runstate.redis_connect import parse_sentinel_url

SENTINELS = "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26380;sentinel://[fd00::3]:26379/2"




def test_the_connection_url_carries_every_sentinel_the_master_and_both_passwords(write):
    broker = load_config(write({"url": SENTINELS, "sentinel_master": "dfq", "username": "worker"}), env={}).broker
    assert broker.uses_sentinel
    url = broker.connection_url({PASSWORD_ENV: "pri:mary@", SENTINEL_PASSWORD_ENV: "sent inel&x="})
    target = parse_sentinel_url(url)
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("fd00::3", 26379))
    assert (target.master_name, target.db, target.username) == ("dfq", 2, "worker")
    assert (target.password, target.sentinel_password) == ("pri:mary@", "sent inel&x=")
    assert "pri:mary" not in target.shown() and "sent" not in target.shown().replace("sentinel", "")


def test_celery_gets_kombus_sentinel_form_and_transport_options(write, tmp_path):
    (tmp_path / "sentinel.password").write_text("from-file\n")
    broker = load_config(write({"url": SENTINELS, "sentinel_master": "dfq"}), env={}).broker
    env = {PASSWORD_ENV: "p", SENTINEL_PASSWORD_FILE_ENV: str(tmp_path / "sentinel.password")}
    assert broker.sentinel_password(env) == "from-file"
    monkey_env = pytest.MonkeyPatch()
    with monkey_env.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        settings = celery_settings(broker, "deploy.toml")
    # kombu reads the primary's credentials from the first address and the database from the last.
    assert settings["broker_url"] == (
        "sentinel://:p@10.0.0.1:26379;sentinel://:p@10.0.0.2:26380;sentinel://:p@[fd00::3]:26379/2"
    )
    options = settings["broker_transport_options"]
    assert options["master_name"] == "dfq" and options["sentinel_kwargs"] == {"password": "from-file"}
    assert options["visibility_timeout"] == broker.visibility_timeout_s


def test_a_plain_url_gets_no_sentinel_options(write):
    broker = load_config(write({"url": "redis://h:6379/0"}), env={}).broker
    settings = celery_settings(broker, "deploy.toml")
    assert settings["broker_url"] == "redis://h:6379/0"
    assert "master_name" not in settings["broker_transport_options"]


@pytest.mark.parametrize(
    ("broker", "said"),
    [
        ({"url": SENTINELS}, r"broker: .*sentinel:// url needs sentinel_master"),
        ({"url": "redis://h:6379/0", "sentinel_master": "dfq"}, r"broker: .*sentinel_master \('dfq'\) is set but url "
                                                                r"is not a sentinel:// URL"),
        ({"url": "sentinel://h:1;redis://h:2/0", "sentinel_master": "dfq"},
         r"broker\.url: .*each sentinel of url must be sentinel://HOST:PORT"),
        ({"url": "sentinel://u:secret@h:1/0", "sentinel_master": "dfq"},
         rf"broker\.url: .*names a user or password.*{SENTINEL_PASSWORD_ENV}"),
        ({"url": "sentinel://h:1/0?master_name=dfq", "sentinel_master": "dfq"},
         r"broker\.url: .*no query in a sentinel url"),
        ({"url": "sentinel://h:1/zero", "sentinel_master": "dfq"}, r"broker\.url: .*must be a number, got 'zero'"),
        ({"url": "sentinel://h:port/0", "sentinel_master": "dfq"}, r"broker\.url: .*port of a sentinel must be a number"),
    ],
)
def test_a_wrong_sentinel_setting_names_the_file_and_key(write, broker, said):
    path = write(broker)
    with pytest.raises(ConfigError, match=said) as refused:
        load_config(path, env={})
    assert str(refused.value).startswith(f"{path}: invalid configuration")
    assert "secret" not in str(refused.value)


def test_an_unreadable_sentinel_password_file_names_the_variable(write, tmp_path):
    broker = load_config(write({"url": SENTINELS, "sentinel_master": "dfq"}), env={}).broker
    with pytest.raises(ConfigError, match=rf"{SENTINEL_PASSWORD_FILE_ENV}: cannot read the sentinels' password .*gone"):
        broker.connection_url({SENTINEL_PASSWORD_FILE_ENV: str(tmp_path / "gone")})
