#!/usr/bin/env python3
"""An S3 server for the tests, as users run one: moto's S3 API on a loopback
port with request signatures checked, one user whose key the tests get, and
a bucket made by that user.

Signatures: moto checks none by default (any key is taken). With
INITIAL_NO_AUTH_ACTION_COUNT=N in its environment at import, every request
after the first N is authenticated against moto's own IAM: the access key
must exist and the SigV4 signature must match its secret, or the answer is
403 (InvalidAccessKeyId / SignatureDoesNotMatch). The first three requests
(unsigned by any real key) make the user, its key and its policy; the bucket
is made with the new key, so the check is on from there.

Faults, for the tests that need a target misbehaving, asked over HTTP at
the same port (never reached by a real S3 client):
  POST /__fault/slowdown?count=N   the next N S3 requests answer 503 SlowDown
  POST /__fault/hang               every S3 request from now on gets no answer
  POST /__fault/clear              both off; hung requests then answer 503
  GET  /__fault/stats              {"requests": n, "slowdowns": n, "hung": n}

Prints one JSON line on stdout, {"endpoint", "bucket", "access_key_id",
"secret_access_key"}, once it answers; runs until standard input closes or
it is killed.
"""

import json
import os
import sys
import threading

os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import boto3  # noqa: E402
from moto.server import DomainDispatcherApplication, create_backend_app  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class Faults:
    """The faults asked for, shared by the server's threads."""

    def __init__(self):
        self.lock = threading.Condition()
        self.slowdown = 0
        self.hang = False
        self.stats = {"requests": 0, "slowdowns": 0, "hung": 0}


def app_with_faults(app, faults):
    def control(environ, start_response):
        path = environ.get("PATH_INFO", "")
        query = dict(
            kv.split("=", 1) for kv in environ.get("QUERY_STRING", "").split("&") if "=" in kv
        )
        with faults.lock:
            if path == "/__fault/slowdown":
                faults.slowdown = int(query.get("count", "1"))
            elif path == "/__fault/hang":
                faults.hang = True
            elif path == "/__fault/clear":
                faults.slowdown = 0
                faults.hang = False
                faults.lock.notify_all()
            elif path != "/__fault/stats":
                start_response("404 Not Found", [("Content-Type", "text/plain")])
                return [b"no such fault\n"]
            body = json.dumps(faults.stats).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]

    def wrapped(environ, start_response):
        if environ.get("PATH_INFO", "").startswith("/__fault/"):
            return control(environ, start_response)
        with faults.lock:
            faults.stats["requests"] += 1
            if faults.hang:
                faults.stats["hung"] += 1
                while faults.hang:
                    faults.lock.wait()
                slow = True
            elif faults.slowdown > 0:
                faults.slowdown -= 1
                faults.stats["slowdowns"] += 1
                slow = True
            else:
                slow = False
        if slow:
            # A request body not read would be taken for the next request.
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length)
            start_response(
                "503 Slow Down",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOWDOWN)))],
            )
            return [SLOWDOWN]
        return app(environ, start_response)

    return wrapped


def main():
    faults = Faults()
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, app_with_faults(app, faults), threaded=True)
    endpoint = f"http://127.0.0.1:{server.server_port}"
    threading.Thread(target=server.serve_forever, daemon=True).start()

    anon = dict(
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam = boto3.client("iam", **anon)
    iam.create_user(UserName="blockplane")
    key = iam.create_access_key(UserName="blockplane")["AccessKey"]
    iam.put_user_policy(
        UserName="blockplane",
        PolicyName="s3",
        PolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
        ),
    )
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key["AccessKeyId"],
        aws_secret_access_key=key["SecretAccessKey"],
    )
    s3.create_bucket(Bucket="bucket")
    print(
        json.dumps(
            {
                "endpoint": endpoint,
                "bucket": "bucket",
                "access_key_id": key["AccessKeyId"],
                "secret_access_key": key["SecretAccessKey"],
            }
        ),
        flush=True,
    )
    # Until the test that started it closes its end.
    sys.stdin.read()
    with faults.lock:
        faults.hang = False
        faults.lock.notify_all()
    server.shutdown()


if __name__ == "__main__":
    main()
