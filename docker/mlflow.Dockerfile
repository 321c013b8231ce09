# The MLflow tracking server of docker-compose.yml, apart from the multi-GB torch image of
# docker/Dockerfile: mlflow (at the version the project's clients run), psycopg 3 for its
# PostgreSQL store (SQLAlchemy 2.1 opens postgresql:// with it), boto3 for an s3:// artifact
# destination (MinIO), Flask-WTF for `--app-name basic-auth` (what mlflow[auth] adds).
# Build context: docker/ (nothing from it is copied).
#   docker build -f docker/mlflow.Dockerfile -t sweeps-mlflow docker
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install "mlflow==3.17.2" "psycopg[binary]==3.3.9" "boto3==1.44.8" "Flask-WTF==1.3.0"

# The auth store (users, permissions): docker-compose.yml mounts a volume here.
RUN mkdir -p /mlflow-auth /mlartifacts
WORKDIR /mlflow-auth
EXPOSE 5000
CMD ["mlflow", "server", "--help"]
