from pathlib import Path

import pytest

from relayr.core.errors import InvalidSettings
from relayr.settings import Settings, default_database_url, redact

EVERY_VARIABLE = {
    "RELAYR_HOME": "/srv/relayr",
    "RELAYR_BROKER_URL": "redis://127.0.0.1:6379/3",
    "RELAYR_DATABASE_URL": "postgresql+asyncpg://relayr@db:5432/relayr",
    "RELAYR_APP": "myapp.rules:build",
    "RELAYR_ALLOWLIST": "/etc/relayr/allowlist.toml",
    "RELAYR_LOG_FORMAT": "json",
    "RELAYR_QUEUE": "runs.fast",
    "RELAYR_LEASE_TTL_S": "12.5",
    "RELAYR_VISIBILITY_TIMEOUT_S": "900",
    "RELAYR_SOFT_TIME_LIMIT_S": "60",
    "RELAYR_TIME_LIMIT_S": "90",
    "RELAYR_MAX_REDELIVERIES": "5",
    "RELAYR_TURN_GRACE_S": "15",
    "RELAYR_DISPATCH_INTERVAL_S": "0.25",
    "RELAYR_REQUEUE_AFTER_S": "120",
}


def test_defaults_need_no_server() -> None:
    settings = Settings.from_env({})

    assert settings.home == Path(".relayr")
    assert settings.broker_url == "filesystem://"
    assert settings.database_url == f"sqlite+aiosqlite:///{Path('.relayr').absolute()}/relayr.db"
    assert settings.database_url.startswith("sqlite+aiosqlite:////")
    assert settings.app == "rules.example:create_app"
    assert settings.allowlist == Path("rules/allowlist.toml")
    assert settings.log_format == "console"
    assert settings.queue == "relayr.runs"
    assert settings.soft_time_limit_s < settings.time_limit_s < settings.visibility_timeout_s
    assert settings.lease_ttl_s == 30
    assert settings.max_redeliveries == 3
    assert settings.requeue_after_s > settings.dispatch_interval_s


def test_every_variable_is_read() -> None:
    settings = Settings.from_env(EVERY_VARIABLE)

    assert settings == Settings(
        home=Path("/srv/relayr"),
        broker_url="redis://127.0.0.1:6379/3",
        database_url="postgresql+asyncpg://relayr@db:5432/relayr",
        app="myapp.rules:build",
        allowlist=Path("/etc/relayr/allowlist.toml"),
        log_format="json",
        queue="runs.fast",
        lease_ttl_s=12.5,
        visibility_timeout_s=900,
        soft_time_limit_s=60,
        time_limit_s=90,
        max_redeliveries=5,
        turn_grace_s=15,
        dispatch_interval_s=0.25,
        requeue_after_s=120,
    )


def test_the_database_follows_home_unless_named() -> None:
    settings = Settings.from_env({"RELAYR_HOME": "/tmp/elsewhere"})

    assert settings.database_url == "sqlite+aiosqlite:////tmp/elsewhere/relayr.db"


def test_empty_variables_take_their_defaults() -> None:
    assert Settings.from_env({"RELAYR_QUEUE": "", "RELAYR_LEASE_TTL_S": "  "}) == Settings()


def test_other_variables_are_ignored() -> None:
    assert Settings.from_env({"RELAYR": "x", "RELAYR_UNKNOWN": "y", "HOME": "/root"}) == Settings()


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RELAYR_LEASE_TTL_S", "soon", "RELAYR_LEASE_TTL_S='soon' is invalid: expected a number"),
        ("RELAYR_LEASE_TTL_S", "0", "RELAYR_LEASE_TTL_S=0.0 is invalid: it must be above 0"),
        ("RELAYR_LEASE_TTL_S", "nan", "RELAYR_LEASE_TTL_S='nan' is invalid: expected a finite"),
        ("RELAYR_REQUEUE_AFTER_S", "-1", "RELAYR_REQUEUE_AFTER_S=-1.0 is invalid"),
        ("RELAYR_DISPATCH_INTERVAL_S", "0", "RELAYR_DISPATCH_INTERVAL_S=0.0 is invalid"),
        ("RELAYR_MAX_REDELIVERIES", "2.5", "RELAYR_MAX_REDELIVERIES='2.5' is invalid: expected a"),
        ("RELAYR_MAX_REDELIVERIES", "-1", "RELAYR_MAX_REDELIVERIES=-1 is invalid: it cannot be"),
        ("RELAYR_TURN_GRACE_S", "-5", "RELAYR_TURN_GRACE_S=-5.0 is invalid: it cannot be"),
        ("RELAYR_FAIR_BATCH", "0", "RELAYR_FAIR_BATCH=0 is invalid: it must be at least 1"),
        ("RELAYR_FAIR_BATCH", "21", "RELAYR_FAIR_BATCH=21 is invalid: it must be at most 20"),
        ("RELAYR_DISPATCH_SHARDS", "5000", "RELAYR_DISPATCH_SHARDS=5000 is invalid: it must be"),
        ("RELAYR_LOG_FORMAT", "xml", "RELAYR_LOG_FORMAT='xml' is invalid: use json or console"),
        ("RELAYR_DATABASE_URL", "mysql://db/relayr", "RELAYR_DATABASE_URL='mysql://db/relayr'"),
        ("RELAYR_DATABASE_URL", "sqlite:///relayr.db", "RELAYR_DATABASE_URL='sqlite:///relayr"),
        ("RELAYR_BROKER_URL", "amqp://rabbit", "RELAYR_BROKER_URL='amqp://rabbit' is invalid"),
        ("RELAYR_APP", "rules.example", "RELAYR_APP='rules.example' is invalid"),
        ("RELAYR_APP", ":create_app", "RELAYR_APP=':create_app' is invalid"),
        ("RELAYR_OTEL", "maybe", "RELAYR_OTEL='maybe' is invalid: use 1 or 0"),
        ("RELAYR_TRACE_URL", "http://jaeger/trace", "RELAYR_TRACE_URL='http://jaeger/trace' is"),
        ("RELAYR_TRACE_URL", "jaeger/{trace_id}", "RELAYR_TRACE_URL='jaeger/{trace_id}' is"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "collector:4317",
            "OTEL_EXPORTER_OTLP_ENDPOINT='collector:4317' is invalid: use an http://",
        ),
    ],
)
def test_invalid_values_are_named(variable: str, value: str, message: str) -> None:
    with pytest.raises(InvalidSettings) as refused:
        Settings.from_env({variable: value})

    assert refused.value.message.startswith(message)
    assert refused.value.code == "invalid_settings"


@pytest.mark.parametrize(
    ("variable", "value", "shown"),
    [
        ("RELAYR_BROKER_URL", "amqp://u:s3cret@h//", "RELAYR_BROKER_URL='amqp://u:***@h//'"),
        (
            "RELAYR_DATABASE_URL",
            "postgresql://user:s3cret@db:5432/relayr",
            "RELAYR_DATABASE_URL='postgresql://user:***@db:5432/relayr'",
        ),
        # a port that is not a number: the parser refuses it, the password still goes
        (
            "RELAYR_BROKER_URL",
            "amqp://u:s3cret@h:port//",
            "RELAYR_BROKER_URL='amqp://u:***@h:port//'",
        ),
        # a '/' left unencoded in the password ends the host for the parser
        ("RELAYR_DATABASE_URL", "mysql://u:s3/cret@db/x", "RELAYR_DATABASE_URL='mysql://***@db/x'"),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "grpc://otel:s3cret@collector:4317",
            "OTEL_EXPORTER_OTLP_ENDPOINT='grpc://otel:***@collector:4317'",
        ),
    ],
)
def test_a_refused_url_never_shows_its_password(variable: str, value: str, shown: str) -> None:
    with pytest.raises(InvalidSettings) as refused:
        Settings.from_env({variable: value})

    assert refused.value.message.startswith(f"{shown} is invalid")
    assert "s3" not in refused.value.message
    assert "cret" not in refused.value.message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://user:p@ss@cache/0", "redis://user:***@cache/0"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("redis://user@cache/0?client=a@b", "redis://user@cache/0?client=a@b"),
        ("filesystem://", "filesystem://"),
        ("redis://[::1:6379/0", "redis://[::1:6379/0"),
    ],
)
def test_redact_hides_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_new_home_moves_the_database_that_followed_the_old_one(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "old")

    moved = settings.changed(home=tmp_path / "new")

    assert moved.database_url == default_database_url(tmp_path / "new")
    named = Settings(home=tmp_path / "old", database_url="postgresql+asyncpg://db/relayr")
    assert named.changed(home=tmp_path / "new").database_url == "postgresql+asyncpg://db/relayr"
    both = settings.changed(home=tmp_path / "new", database_url="memory://")
    assert both.database_url == "memory://"
    assert settings.changed(queue="other").database_url == settings.database_url


@pytest.mark.parametrize(
    ("soft", "hard", "visibility"),
    [
        ("60", "60", "900"),  # soft == hard
        ("90", "60", "900"),  # soft > hard
        ("60", "900", "900"),  # hard == visibility
        ("60", "1000", "900"),  # hard > visibility
        ("1000", "2000", "900"),  # both above visibility
    ],
)
def test_time_limits_must_be_ordered(soft: str, hard: str, visibility: str) -> None:
    environ = {
        "RELAYR_SOFT_TIME_LIMIT_S": soft,
        "RELAYR_TIME_LIMIT_S": hard,
        "RELAYR_VISIBILITY_TIMEOUT_S": visibility,
    }

    with pytest.raises(InvalidSettings, match="time limits are out of order") as refused:
        Settings.from_env(environ)

    for variable in environ:
        assert variable in refused.value.message


def test_the_ordering_invariant_holds_for_a_short_visibility_timeout() -> None:
    settings = Settings.from_env(
        {
            "RELAYR_SOFT_TIME_LIMIT_S": "5",
            "RELAYR_TIME_LIMIT_S": "8",
            "RELAYR_VISIBILITY_TIMEOUT_S": "10",
        }
    )

    assert (settings.soft_time_limit_s, settings.time_limit_s) == (5, 8)


def test_settings_are_frozen() -> None:
    settings = Settings()

    with pytest.raises(AttributeError):
        settings.queue = "other"  # type: ignore[misc]


def test_redis_transport_options_carry_the_visibility_timeout() -> None:
    settings = Settings.from_env(
        {"RELAYR_BROKER_URL": "redis://127.0.0.1:6379/0", "RELAYR_VISIBILITY_TIMEOUT_S": "900"}
    )

    assert settings.broker_transport_options() == {"visibility_timeout": 900}


def test_the_embedded_broker_s_options_name_its_folder_in_the_home(tmp_path: Path) -> None:
    settings = Settings.from_env({"RELAYR_HOME": str(tmp_path / "home")})

    # the transport makes its layout there when it first connects (relayr.broker.layout)
    assert settings.broker_transport_options() == {
        "folder": str(tmp_path / "home" / "broker"),
        "polling_interval": 0.05,
    }


def test_the_embedded_broker_s_polling_interval_is_a_setting(tmp_path: Path) -> None:
    settings = Settings.from_env(
        {"RELAYR_HOME": str(tmp_path), "RELAYR_BROKER_POLL_INTERVAL_S": "30"}
    )

    assert settings.broker_transport_options()["polling_interval"] == 30.0
    with pytest.raises(InvalidSettings, match="RELAYR_BROKER_POLL_INTERVAL_S"):
        Settings.from_env({"RELAYR_BROKER_POLL_INTERVAL_S": "0"})


def test_memory_transport_needs_no_options() -> None:
    assert Settings(broker_url="memory://").broker_transport_options() == {}


def test_tracing_is_off_by_default() -> None:
    settings = Settings.from_env({})

    assert not settings.tracing
    assert settings.otlp_endpoint == "http://localhost:4318"


@pytest.mark.parametrize(
    ("environ", "tracing"),
    [
        ({"RELAYR_OTEL": "1"}, True),
        ({"RELAYR_OTEL": "0"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "RELAYR_OTEL": "0"}, False),
        ({"OTEL_SERVICE_NAME": "relayr-eu"}, False),
    ],
)
def test_tracing_is_on_by_relayr_otel_or_an_endpoint(
    environ: dict[str, str], tracing: bool
) -> None:
    assert Settings.from_env(environ).tracing is tracing


def test_opentelemetry_s_standard_variables_are_read_by_their_names() -> None:
    settings = Settings.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.example:4318/", "OTEL_SERVICE_NAME": "eu"}
    )

    assert settings.otlp_endpoint == "https://otel.example:4318"
    assert settings.otel_service_name == "eu"
    # not under relayr's prefix: one name for one setting
    assert Settings.from_env({"RELAYR_OTEL_ENDPOINT": "http://elsewhere"}).otel_endpoint == ""
