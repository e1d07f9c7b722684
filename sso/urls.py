from django.urls import path

from . import views

app_name = "sso"
urlpatterns = [
    path("authenticate/", views.sign_in_start, name="authenticate"),
    # The redirect URI to register at the identity provider: https://<host>/sso/callback/
    path("callback/", views.sign_in_callback, name="callback"),
    path("refused/", views.refused, name="refused"),
]
