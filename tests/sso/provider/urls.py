import json

from django.contrib.auth import views as auth_views
from django.contrib.auth.models import Group, User
from django.http import JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from oauth2_provider.models import Application


@csrf_exempt
def control(request):
    """The test's hand on the provider's directory: register the client, put, move or remove a person."""
    body = json.loads(request.body)
    action = body["action"]
    if action == "client":
        Application.objects.filter(client_id=body["client_id"]).delete()
        Application.objects.create(
            name="platform",
            client_id=body["client_id"],
            client_secret=body["client_secret"],
            client_type=Application.CLIENT_CONFIDENTIAL,
            authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
            redirect_uris=body["redirect_uri"],
            algorithm=Application.RS256_ALGORITHM,
            skip_authorization=True,
        )
    elif action == "person":
        user, _ = User.objects.get_or_create(username=body["username"])
        user.email = body.get("email", "")
        user.set_password(body["password"])  # which also signs them out at the provider
        user.save()
        user.groups.set([Group.objects.get_or_create(name=name)[0] for name in body["groups"]])
    elif action == "groups":  # as a directory's admin moves someone: their session at the provider goes on
        User.objects.get(username=body["username"]).groups.set(
            [Group.objects.get_or_create(name=name)[0] for name in body["groups"]]
        )
    elif action == "remove":
        User.objects.filter(username=body["username"]).delete()
    return JsonResponse({"ok": True})


urlpatterns = [
    path("o/", include("oauth2_provider.urls", namespace="oauth2_provider")),
    path("accounts/login/", auth_views.LoginView.as_view(template_name="login.html")),
    path("control/", control),
]
